"""Named mutations of `src/`: each breaks one guarantee on purpose; the tests meant to catch it must fail.

`make mutants` (or `python bench/mutants.py`) applies the mutations of `MUTATIONS` one at a time: an exact
text substitution in one file (the old text must occur exactly once, so a mutation never goes stale
silently), runs its catching tests (`pytest -x -q -p no:cacheprovider`), requires them to fail (red), then
restores the file, always, and checks the restored file's SHA-256 against the original. The table
(mutation, file, catching tests, result, seconds) goes into docs/testing.md between the markers
`<!-- mutants:begin -->` and `<!-- mutants:end -->`, and as JSON into bench/results/mutants.json.

    python bench/mutants.py                  every mutation; exit 1 if one survives (green) or is stale
    python bench/mutants.py --only NAME ...  these mutations only (their rows replace those of the recorded run)
    python bench/mutants.py --list           the names, files and catching tests (and a staleness check)
    python bench/mutants.py --baseline       the catching tests on the unmutated tree (they must pass)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "testing.md"
OUT = REPO / "bench" / "results" / "mutants.json"
BEGIN, END = "<!-- mutants:begin -->", "<!-- mutants:end -->"
TEST_TIMEOUT_S = 600.0  # one mutation's catching tests (a hung run under a mutation counts as caught)


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str  # the guarantee it breaks, in words
    file: str  # relative to src/phoenixft/
    old: str
    new: str
    tests: tuple[str, ...]  # pytest node ids


_HOT = "tests/test_hotswap.py::test_kill_in_every_phase_is_bitwise_invisible[optimizer-0-auto]"
_INV = "tests/test_invariants.py::test_each_invariant_is_false_exactly_when_its_condition_is_violated"
_SCRUB_INSTALL = "tests/test_scrub.py::test_a_repair_installs_only_a_copy_that_verifies_against_the_committed_checksum"
_SCRUB_SERVE = "tests/test_scrub.py::test_a_peer_serves_only_bytes_that_match_the_checksum_asked_for_hashed_when_asked"
_DONE_UNIT = "tests/test_auth.py::test_a_done_is_believed_only_from_the_node_at_rank_0_of_the_signed_topology"

MUTATIONS: tuple[Mutation, ...] = (
    Mutation("restore_previous_step", "a survivor restores the parameters of the step before the resume step",
             "recovery/restore.py",
             "if not need_params and not tr.flat.select(r):",
             "if not need_params and not tr.flat.select(r - 1):",
             (_HOT,)),
    Mutation("restore_previous_optimizer_step", "a survivor keeps its optimizer half of the step before",
             "recovery/restore.py",
             "half = tr.state.half_with(r)\n",
             "half = tr.state.half_with(r - 1)\n",
             (_HOT,)),
    Mutation("wrong_shard_id", "a received optimizer shard is committed under another rank's shard id",
             "recovery/restore.py",
             'st.commit(rx.half, r, t["crc"], (t["shard"], w))',
             'st.commit(rx.half, r, t["crc"], ((t["shard"] + 1) % w, w))',
             (_HOT,)),
    Mutation("checksum_skipped", "a snapshot half verifies without comparing its checksum",
             "protect/snapshot.py",
             "ok = bool(int(self.header[half, 2])) and checksum(self.payload(half)) == int(self.header[half, 1])",
             "ok = bool(int(self.header[half, 2]))",
             ("tests/test_invariants.py::test_i3_on_a_survivors_own_half_never_skips",
              "tests/test_integrity.py::test_the_sender_uses_whichever_half_of_the_step_verifies")),
    Mutation("stale_half", "verified_half returns the other half of the ping-pong pair",
             "protect/snapshot.py",
             "if self.step_of(h) == step and (self.verified(h) or self.verify(h)):\n                return h",
             "if self.step_of(h) == step and (self.verified(h) or self.verify(h)):\n                return 1 - h",
             ("tests/test_integrity.py::test_the_sender_uses_whichever_half_of_the_step_verifies",)),
    Mutation("replica_on_owner_node", "a replica round at ring offset 0: the owner's own node keeps its replica",
             "distributed/topology.py",
             "o = 1  # then the nearest others",
             "o = 0  # then the nearest others",
             ("tests/test_mesh.py::test_replicas_on_data_parallel_peers_of_other_nodes",
              "tests/test_mesh.py::test_replica_rounds_whole_racks_away_first_then_the_nearest_nodes")),
    Mutation("agent_ignores_fence", "an agent fenced by the control plane keeps its node running",
             "runtime/agent.py",
             "if fenced_now and sealed.has(store, keys.fence(node)):",
             "if False:",
             ("tests/test_integrity.py::test_fenced_node_resumed_after_its_fence_writes_nothing",)),
    Mutation("worker_ignores_fence", "a fenced worker goes on writing to the store",
             "core/member.py",
             "if sealed.has(self.ctx.store, keys.fence(self.node_id)):",
             "if False:",
             ("tests/test_integrity.py::test_a_fenced_worker_that_fails_writes_nothing",)),
    Mutation("agent_keeps_segments", "an agent does not unlink its node's shared memory at exit",
             "runtime/agent.py",
             "shm.unlink_segments(self.run_id, self.node)\n            if self.registered:",
             "if self.registered:",
             (_HOT,)),
    Mutation("planner_ignores_bad_source", "the planner counts a copy that already failed verification",
             "recovery/planner.py",
             "if (shard, st, w) not in bad:",
             "if True:",
             ("tests/test_planner.py::test_bad_source_is_avoided_and_the_other_replica_used",)),
    Mutation("chaos_corrupt_one_step_early", "the chaos corrupt fault damages the replicas of the step before",
             "faults/scenarios.py",
             'f"corrupt:node={holder}@step={d.s}",',
             'f"corrupt:node={holder}@step={d.s - 1}",',
             ("tests/test_chaos.py::test_a_corrupt_fault_passes_only_when_recovery_rejected_the_copy_it_corrupted",)),
    Mutation("persist_check_misses_a_rank", "a checkpoint is verified without its last rank's files",
             "protect/persist.py",
             'for r in range(int(man["shards"])):\n        d = root / f"rank{r}"',
             'for r in range(int(man["shards"]) - 1):\n        d = root / f"rank{r}"',
             ("tests/test_persistent.py::test_resume_skips_a_damaged_checkpoint_for_the_newest_that_verifies"
              "[flipped]",)),
    Mutation("planner_oldest_step", "the planner resumes from the oldest feasible step, not the newest",
             "recovery/planner.py",
             "r = max(steps)",
             "r = min(steps)",
             ("tests/test_planner.py::test_planner_against_generated_schedules",)),
    Mutation("planner_new_node_skipped", "a dead node's slot is dropped although a spare is ready",
             "recovery/planner.py",
             "elif pool:\n            nodes.append(pool.pop(0))",
             "elif pool and False:\n            nodes.append(pool.pop(0))",
             ("tests/test_planner.py::test_planner_against_generated_schedules",)),
    Mutation("placement_parity_on_member", "a parity block may land on a member of its own group",
             "protect/redundancy/placement.py",
             "            key[pos] = np.iinfo(np.int64).max\n",
             "",
             ("tests/test_redundancy.py::test_placement_properties_over_generated_rings",)),
    Mutation("xor_drops_a_block", "the XOR parity leaves out the second data block",
             "protect/redundancy/codes.py",
             "for b in blocks[1:]:",
             "for b in blocks[2:]:",
             ("tests/test_redundancy.py::test_codes_rebuild_every_erasure_pattern_bit_for_bit",)),
    Mutation("code_accepts_too_few_pieces", "a decode is attempted with one piece fewer than d",
             "protect/redundancy/codes.py",
             "if len(have) < d:",
             "if len(have) < d - 1:",
             ("tests/test_redundancy.py::test_codes_are_position_wise_and_refuse_too_few_pieces",)),
    Mutation("layout_dp_coordinate", "the data-parallel coordinate ignores the tensor-parallel stride",
             "parallel/layout.py",
             "dp=(rank // t) % d,",
             "dp=rank % d,",
             ("tests/test_mesh.py::test_layout_is_megatron_order_and_groups_partition_the_world",)),
    Mutation("spec_duplicate_node", "a fault naming the same node twice is accepted",
             "faults/spec.py",
             "    if dup:\n",
             "    if False:\n",
             ("tests/test_faults.py::test_bad_spec_is_one_line_saying_what_is_wrong",)),
    Mutation("spec_negative_wait", "a negative wait= is accepted",
             "faults/spec.py",
             "if wait < 0:",
             "if wait < -1:",
             ("tests/test_faults.py::test_bad_spec_is_one_line_saying_what_is_wrong",)),
    Mutation("kind_strikes_wrong_rank", "a crash fault strikes every rank but its own",
             "faults/kinds.py",
             "return rank == f.rank",
             "return rank != f.rank",
             ("tests/test_fault_kinds.py::test_whom_a_fault_strikes_and_what_it_holds",)),
    Mutation("chaos_schedule_unsurvivable", "the chaos schedule keeps faults that cannot be survived",
             "faults/chaos.py",
             "return allow_unsurvivable or unsurvivable_reason(cur, pair, step) is None",
             "return True",
             ("tests/test_chaos.py::test_schedule_is_deterministic_spaced_and_valid",)),
    Mutation("invariant_i4_ignores_optimizer", "I4 holds whatever step the optimizer state is at",
             "recovery/invariants.py",
             '"I4": [x[2] for x in rows if not (x[4] == r and x[5] == r) or x[9] not in (NO_EVIDENCE, NO_MATCH, r)',
             '"I4": [x[2] for x in rows if not (x[4] == r)',
             (_INV,)),
    Mutation("invariants_missing_pass", "a recovery entry without an invariant shows as passing",
             "recovery/invariants.py",
             "return [k for k in INVARIANTS if inv.get(k) is not True]",
             "return [k for k in INVARIANTS if inv.get(k) is False]",
             ("tests/test_invariants.py::test_an_entry_without_all_four_invariants_true_never_passes",)),
    Mutation("config_threads_unbounded", "--threads beyond the limit is accepted",
             "config/parallelism.py",
             "need(0 <= p.threads <= MAX_THREADS,",
             "need(0 <= p.threads,",
             ("tests/test_config.py::test_threads_out_of_range_are_refused",)),
    Mutation("signed_run_end_unverified", "a run end is believed without checking its signature",
             "controlplane/signed.py",
             "if token and hmac.compare_digest(sig, sign(token, run_id, name, value).encode()):",
             "if token:",
             ("tests/test_hostile_store.py::test_signed_values_verify_only_with_the_run_key",)),
    Mutation("sealed_value_unverified", "a sealed store value is believed without checking its MAC",
             "controlplane/sealed.py",
             "if ok and hmac.compare_digest(raw[len(PREFIX):_HEAD - 1], _mac(name, value)):",
             "if ok:",
             ("tests/test_hostile_store.py::test_sealed_values_verify_only_under_their_run_key_and_name",)),
    Mutation("fence_unverified", "a fence nobody of the job wrote stops a healthy node",
             "runtime/agent.py",
             "if fenced_now and sealed.has(store, keys.fence(node)):",
             "if fenced_now:",
             ("tests/test_hostile_store.py::test_a_stranger_cannot_crash_fake_or_steer_a_run[tcpstore]",)),
    Mutation("tls_gateway_no_client_certificate", "the TLS gateway lets in a client without a certificate",
             "controlplane/tlsproxy.py",
             "    ctx.verify_mode = ssl.CERT_REQUIRED\n    return ctx\n\n\ndef client_context",
             "    ctx.verify_mode = ssl.CERT_OPTIONAL\n    return ctx\n\n\ndef client_context",
             ("tests/test_tls.py::test_the_gateway_refuses_a_client_without_a_certificate_of_the_job_ca",)),
    Mutation("sealed_mac_not_bound_to_name", "a sealed value's MAC does not bind its key's name",
             "controlplane/sealed.py",
             'm.update(name.encode() + b"\\0" + value)',
             "m.update(value)",
             ("tests/test_hostile_store.py::test_sealed_values_verify_only_under_their_run_key_and_name",)),
    Mutation("signed_mac_not_bound_to_name", "a signed value's MAC does not bind its key's name",
             "controlplane/signed.py",
             'return hmac.new(run_key(token, run_id), name.encode() + b"\\0" + v, hashlib.sha256).hexdigest()',
             "return hmac.new(run_key(token, run_id), v, hashlib.sha256).hexdigest()",
             ("tests/test_hostile_store.py::test_signed_values_verify_only_with_the_run_key",)),
    Mutation("json_nesting_unbounded", "a value nested a million deep reaches json.loads (a RecursionError)",
             "controlplane/values.py",
             '    if _depth(b) > MAX_DEPTH:\n        return f"nested deeper than {MAX_DEPTH} levels", None\n',
             "",
             ("tests/test_hostile_store.py::test_json_readers_are_total_over_generated_junk",)),
    Mutation("front_lets_other_users_in", "the store's front lets in a local connection of another user",
             "controlplane/tlsproxy.py",
             "if peer.local and peer.uid != self.me:",
             "if peer.local and peer.uid is None:",
             ("tests/test_local_users.py::test_the_front_lets_in_this_users_processes_only",)),
    Mutation("spike_window_reset_at_join", "the spike guard starts empty after a join (nothing flagged for 8 steps)",
             "sdc/checks.py",
             "        if not self.guarded or resume_step < 1:\n            return\n        names",
             "        if True:\n            return\n        names",
             ("tests/test_sdc.py::test_the_spike_guard_guards_the_steps_right_after_a_hot_swap",)),
    Mutation("spike_window_kept_at_join", "a survivor keeps its own spike window at a join (rolled-back steps in it)",
             "sdc/checks.py",
             "        self.guard.reset()\n        if not self.guarded or resume_step < 1:",
             "        if not self.guarded or resume_step < 1:",
             ("tests/test_sdc.py::test_after_a_join_the_spike_window_is_the_runs_committed_steps_up_to_the_resume_step",)),
    Mutation("evidence_from_header", "the invariants' evidence identifies an install by its header's checksum, not "
             "by its bytes", "recovery/evidence.py",
             "opt_crc = checksum(trainer.state.payload(half)) if half is not None else None",
             "opt_crc = trainer.state.crc_of(half) if half is not None else None",
             ("tests/test_evidence.py::test_a_header_that_claims_the_right_checksum_over_other_bytes_is_refused_by_"
              "the_evidence",)),
    Mutation("scrub_repair_installs_unverified", "a scrub repair installs a copy that does not match the committed "
             "checksum", "protect/scrub_repair.py",
             "    if checksum(good) != crc:\n        raise LookupError(f\"the copy {src} sent",
             "    if False:\n        raise LookupError(f\"the copy {src} sent",
             (_SCRUB_INSTALL,)),
    Mutation("scrub_serves_own_unverified", "a peer serves its own committed half for a repair without hashing it",
             "protect/scrub_repair.py",
             "return t if checksum(t) == a.crc else None",
             "return t",
             (_SCRUB_SERVE,)),
    Mutation("scrub_serves_held_unverified", "a peer serves its replica for a repair on its header's word, unhashed",
             "protect/scrub_repair.py",
             "\n                     and checksum(h.payload(x)) == a.crc), None)",
             "), None)",
             (_SCRUB_SERVE,)),
    Mutation("failed_verify_stays_verified", "a half whose verification failed still counts as verified",
             "protect/snapshot.py",
             "        else:  # (bytes that changed at rest since an earlier verification are not "
             "\"verified\" any more)\n            self._verified.pop(half, None)\n",
             "",
             (_SCRUB_SERVE,)),
    Mutation("json_non_finite_accepted", "a value holding 1e999 (infinity once parsed) reaches its reader",
             "controlplane/values.py",
             "    if not math.isfinite(f):\n",
             "    if False:\n",
             ("tests/test_hostile_store.py::test_numbers_a_value_of_the_job_cannot_hold_are_refused",)),
    Mutation("token_file_of_another_user", "a token file another user owns (and can rewrite) is accepted",
             "controlplane/tokens.py",
             "        if st.st_uid != os.getuid():",
             "        if False:",
             ("tests/test_hostile_store.py::test_token_files_must_be_private_and_tokens_strong",)),
    Mutation("signed_empty_token_believed", "a reader without a token believes a value signed with the empty token",
             "controlplane/signed.py",
             "if token and hmac.compare_digest(sig, sign(token, run_id, name, value).encode()):",
             "if hmac.compare_digest(sig, sign(token, run_id, name, value).encode()):",
             ("tests/test_hostile_store.py::test_signed_values_verify_only_with_the_run_key",)),
    Mutation("read_topology_unverified",
             "a topology read for a display, a drain or a run end's writer is not checked against its signature",
             "controlplane/signed.py",
             "if sig is None or not same(bytes(sig), sign_topology(token, epoch, bytes(raw))):",
             "if sig is None:",
             ("tests/test_auth.py::test_workers_act_only_on_signed_topologies",)),
    Mutation("run_end_any_writer", "a run end is believed whichever node its final-state record names",
             "controlplane/signed.py",
             "    if node != rank0:\n",
             "    if False:\n",
             (_DONE_UNIT, "tests/test_hostile_store.py::test_a_run_ends_done_only_by_the_node_at_rank_0")),
    Mutation("run_end_carried_topology_unverified", "the topology a run end's record carries is believed unsigned",
             "controlplane/signed.py",
             "            not same(sig, sign_topology(token, e, raw.encode())):",
             "            False:",
             ("tests/test_auth.py::test_rank_0s_end_record_carries_its_signed_topology",)),
    Mutation("run_done_without_final", "a signed \"done\" ends the run without rank 0's final-state record beside it",
             "controlplane/signed.py",
             "    if state == DONE and final_record(store, tok, run_id) is None:",
             "    if False:",
             (_DONE_UNIT,)),
)


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _path(m: Mutation) -> Path:
    return REPO / "src" / "phoenixft" / m.file


def check_fresh(ms: tuple[Mutation, ...]) -> list[str]:
    """Every mutation's old text occurs exactly once in its file (else the mutation has gone stale)."""
    bad = []
    for m in ms:
        n = _path(m).read_text().count(m.old)
        if n != 1:
            bad.append(f"{m.name}: its old text occurs {n} times in src/phoenixft/{m.file} (must be exactly once)")
    return bad


def apply_one(m: Mutation) -> dict[str, object]:
    """Mutate, run the catching tests, restore (always) and check the restore; the row of the table."""
    p = _path(m)
    original = p.read_bytes()
    digest = hashlib.sha256(original).hexdigest()
    text = original.decode()
    if text.count(m.old) != 1:
        raise SystemExit(f"mutants: {m.name}: old text occurs {text.count(m.old)} times in {p} (must be once)")
    t0 = time.monotonic()
    try:
        p.write_text(text.replace(m.old, m.new))
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *m.tests]
        try:
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=TEST_TIMEOUT_S,
                                  env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
            lines = (proc.stdout + proc.stderr).strip().splitlines()
            rc, tail = proc.returncode, [x for x in lines if x.startswith("E ")][:4] + lines[-1:]
        except subprocess.TimeoutExpired:
            rc, tail = -1, [f"timed out after {TEST_TIMEOUT_S:.0f}s"]
    finally:
        p.write_bytes(original)
        if _sha(p) != digest:
            raise SystemExit(f"mutants: {p} was not restored (its SHA-256 differs): restore it with git checkout")
    # pytest: 1 = tests failed (red); 0 = all passed (the mutation survived); 2..5 = the run itself broke
    result = "red" if rc in (1, -1) else "SURVIVED" if rc == 0 else f"error (pytest exit {rc})"
    return {"name": m.name, "what": m.what, "file": f"src/phoenixft/{m.file}", "tests": list(m.tests),
            "result": result, "seconds": round(time.monotonic() - t0, 1), "tail": tail}


def _first_failure(tail: list[str]) -> str:
    """The first assertion line the catching tests printed, short (what turned them red)."""
    lines = [x[1:].strip() for x in tail if x.startswith("E ")]
    text = lines[0] if lines else ""
    return (text[:110] + "...") if len(text) > 110 else text


def table(rows: list[dict[str, object]]) -> str:
    out = ["| mutation | file | catching tests | result | first failure | seconds |", "|---|---|---|---|---|---|"]
    for r in rows:
        tests = "<br>".join(f"`{t}`" for t in r["tests"])  # type: ignore[attr-defined]
        why = _first_failure(r.get("tail", [])).replace("|", "\\|").replace("`", "'")  # type: ignore[arg-type]
        out.append(f"| `{r['name']}`: {r['what']} | `{r['file']}` | {tests} | {r['result']} | {why} | "
                   f"{r['seconds']} |")
    return "\n".join(out)


def write_doc(rows: list[dict[str, object]]) -> None:
    text = DOC.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"mutants: {DOC} lacks the markers {BEGIN} / {END}")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    DOC.write_text(f"{head}{BEGIN}\n{table(rows)}\n{END}{tail}")


def merged(rows: list[dict[str, object]]) -> list[dict[str, object]] | None:
    """The recorded run's rows with `rows` in place of theirs, when together they cover every mutation."""
    try:
        old = {r["name"]: r for r in json.loads(OUT.read_text())["mutations"]}
    except (OSError, ValueError, KeyError):
        return None
    by_name = old | {r["name"]: r for r in rows}
    if any(m.name not in by_name for m in MUTATIONS):
        return None
    return [by_name[m.name] for m in MUTATIONS]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", metavar="NAME",
                    help="run these mutations only (their rows replace the recorded run's)")
    ap.add_argument("--list", action="store_true", help="list the mutations, check none is stale, and exit")
    ap.add_argument("--baseline", action="store_true", help="run the catching tests on the unmutated tree and exit")
    a = ap.parse_args(argv)
    names = {m.name for m in MUTATIONS}
    if len(names) != len(MUTATIONS):
        raise SystemExit("mutants: two mutations share a name")
    if a.list:
        for m in MUTATIONS:
            print(f"{m.name:34} src/phoenixft/{m.file:34} {' '.join(m.tests)}")
        stale = check_fresh(MUTATIONS)
        print("\n".join(stale) or f"{len(MUTATIONS)} mutations, each old text found exactly once")
        return 1 if stale else 0
    if a.baseline:  # the catching tests pass on the unmutated tree (else "red" would prove nothing)
        tests = sorted({t for m in MUTATIONS if not a.only or m.name in a.only for t in m.tests})
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
                              cwd=REPO).returncode
    unknown = sorted(set(a.only or ()) - names)
    if unknown:
        raise SystemExit(f"mutants: no mutation named {', '.join(unknown)} (see --list)")
    chosen = tuple(m for m in MUTATIONS if not a.only or m.name in a.only)
    stale = check_fresh(chosen)
    if stale:
        raise SystemExit("mutants: stale mutations:\n  " + "\n  ".join(stale))
    rows = []
    for m in chosen:
        row = apply_one(m)
        rows.append(row)
        print(f"{row['result']:>8}  {row['seconds']:6.1f}s  {m.name}", flush=True)
        if row["result"] != "red" or a.only:  # (what the tests said: the red ones' first failure)
            print("          " + "\n          ".join(row["tail"]), flush=True)  # type: ignore[arg-type]
    record = merged(rows) if a.only else rows
    if record is not None:  # (a partial run updates its rows of a recorded full run, in the list's order)
        OUT.parent.mkdir(parents=True, exist_ok=True)
        from benchlib import scrub_paths  # (no path of this machine in a result: the test tails hold some)

        OUT.write_text(json.dumps(scrub_paths({"mutations": record, "red": sum(r["result"] == "red" for r in record),
                                               "total": len(record)}), indent=1) + "\n")
        write_doc(record)
    survivors = [r["name"] for r in rows if r["result"] != "red"]
    print(f"mutants: {len(rows) - len(survivors)}/{len(rows)} red" + (f"; not red: {', '.join(survivors)}"  # type: ignore[arg-type]
                                                                     if survivors else ""))
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
