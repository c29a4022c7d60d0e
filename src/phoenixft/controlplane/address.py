"""Control-plane addresses and specs: what `--control-plane`, `--store` and `--coordinator` name, and
the control plane the launcher provisions for a run.

- `describe(addr)`: what an address names (`HOST:PORT` of a TCPStore, or the URL of an etcd cluster
  with the job's key prefix), its endpoints (for a reachability probe) and whether it is replicated;
- `validate_spec(value)` / `remote_spec_problem(value)`: why a `--control-plane` value is invalid
  (anywhere / for a job whose nodes are on other hosts);
- `provision_cluster(spec, run_id, ...)`: the job's address on the cluster a spec names (starting a
  local one for `etcd`), probed before anything starts; its handle kills members (fault injection)
  and stops the cluster it started.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from phoenixft.controlplane.etcd_cluster import EtcdCluster
from phoenixft.controlplane.etcd_store import EtcdError, EtcdStore, EtcdUnavailable, job_credentials, parse_etcd_url
from phoenixft.controlplane.store import Store, count_opened, tcp_client
from phoenixft.controlplane.tls import TlsFiles
from phoenixft.controlplane.tls import from_env as tls_from_env
from phoenixft.controlplane.tokens import TOKEN_ENV
from phoenixft.errors import UserError

__all__ = ["StoreAddress", "connect", "describe", "validate_spec", "remote_spec_problem", "ProvisionedCluster",
           "provision_cluster", "CLUSTER_PROBE_S"]

CLUSTER_PROBE_S = 10.0  # how long a cluster control plane may take to answer before the run is refused
_SCHEME = "etcd://"


@dataclass(frozen=True)
class StoreAddress:
    """What a store address names (`describe`)."""

    text: str
    replicated: bool  # a cluster of members (a URL): any of them answers, the job outlives each

    @property
    def name(self) -> str:
        """What serves it, for messages."""
        return "etcd" if self.replicated else "the store"

    def endpoints(self) -> list[tuple[str, int]]:
        """[(host, port)...]; ValueError naming what is wrong."""
        if self.replicated:
            return parse_etcd_url(self.text)[0]
        host, sep, port = self.text.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError("expected HOST:PORT, e.g. 127.0.0.1:29500, or etcd://HOST:PORT[,HOST:PORT...]/PREFIX")
        return [(host.strip("[]"), int(port))]

    def job_prefix(self) -> str:
        """The key prefix a cluster URL names ("" if none); ValueError if it is not a cluster URL."""
        return parse_etcd_url(self.text)[1]


def describe(addr: str) -> StoreAddress:
    """What `addr` names (nothing is checked or contacted: see `StoreAddress.endpoints`)."""
    return StoreAddress(addr, addr.startswith(_SCHEME))


def validate_spec(value: str) -> str | None:
    """Why `--control-plane=value` is invalid, or None."""
    if value in ("tcpstore", "etcd"):
        return None
    if value.startswith(_SCHEME):
        try:
            parse_etcd_url(value)
        except ValueError as e:
            return str(e)
        return None
    return ("valid: tcpstore (embedded, the default), etcd (a local 3-member etcd cluster started for the run) "
            "or etcd://HOST:PORT[,HOST:PORT...] (an existing cluster)")


def remote_spec_problem(value: str) -> str | None:
    """Why `--control-plane=value` is invalid for a job whose nodes are on other hosts, or None."""
    if value == "etcd":
        return ("--control-plane=etcd is invalid here: it starts a cluster on this host's loopback, which "
                "agents on other hosts cannot reach; run etcd on your hosts and give "
                "--control-plane etcd://HOST:PORT,HOST:PORT,HOST:PORT")
    return None


class ProvisionedCluster:
    """The cluster a run's control plane lives on: `addr` (the job's URL, keys under its own prefix)
    and, for `--control-plane etcd`, the local cluster this run started (killed members, stopped)."""

    def __init__(self, addr: str, local: EtcdCluster | None) -> None:
        self.addr = addr
        self._local = local

    def member(self, index: int) -> tuple[int, str]:
        """Member `index` (-1: the raft leader) of the cluster this run started: its index and name."""
        if self._local is None:
            raise RuntimeError("only a cluster the run started itself can lose a member (--control-plane etcd)")
        i = index if index >= 0 else self._local.leader_index()
        return i, f"etcd member m{i}" + (" (raft leader)" if index < 0 else "")

    def kill_member(self, i: int) -> None:
        """SIGKILL member `i` of the cluster this run started."""
        if self._local is None:
            raise RuntimeError("only a cluster the run started itself can lose a member (--control-plane etcd)")
        self._local.kill(i)

    def stop(self) -> None:
        """Stop the cluster this run started (a given one is left running)."""
        if self._local is not None:
            self._local.stop()
            self._local = None


def provision_cluster(spec: str, run_id: str, log_dir: str, info: Callable[[str], None],
                      probe_s: float = CLUSTER_PROBE_S, tls: TlsFiles | None = None,
                      token: str | None = None) -> ProvisionedCluster:
    """The job's cluster for `--control-plane=spec` (not tcpstore): the cluster given (or a local one
    started now), keys under `<prefix>/<run id>` (prefix `/phoenixft` unless the URL names one),
    answering within `probe_s`; UserError naming the flag if it cannot be had. With `tls` a local cluster
    serves HTTPS only and admits clients with a certificate of the job CA (members among themselves too),
    and with the job `token` too its users are on: the job's user (`etcd_store.job_credentials`) may
    read and write the job's prefix only; a given cluster is spoken to over HTTPS (this process's clients
    take the files from its environment)."""
    url = spec
    local: EtcdCluster | None = None
    if spec == "etcd":
        try:
            local = EtcdCluster(3, log_dir=log_dir, tag=run_id, tls=tls).start()
        except (FileNotFoundError, RuntimeError, TimeoutError) as e:
            raise UserError(f"--control-plane=etcd: could not start a local etcd cluster ({e})") from None
        url = local.url
        info(f"started a local 3-member etcd cluster for this run: {url}")
    eps, prefix = parse_etcd_url(url)
    job_prefix = f"{prefix or '/phoenixft'}/{run_id}"
    addr = _SCHEME + ",".join(f"{h}:{p}" for h, p in eps) + job_prefix
    if local is not None and tls is not None and token:
        _restrict(local, tls, job_prefix, token, info)
    try:  # one bounded look before anything starts: a wrong address is one line, not a 30 s traceback
        connect(addr, probe_s, tls, token).num_keys()
    except (EtcdUnavailable, EtcdError) as e:
        if local is not None:
            local.stop()
        raise UserError(f"--control-plane={spec}: no etcd cluster answered there within "
                        f"{probe_s:g}s ({str(e).rsplit('(last: ', 1)[-1].rstrip(')')}); give the client "
                        "URLs of a running cluster, or --control-plane etcd to start one here") from None
    return ProvisionedCluster(addr, local)


def _restrict(local: EtcdCluster, tls: TlsFiles, job_prefix: str, token: str, info: Callable[[str], None]) -> None:
    """Turn the local cluster's users on: the job's user may use the job's prefix only."""
    cn = tls.common_name()
    if cn:
        info(f"etcd access is not limited to the job's prefix: --tls-cert={tls.cert} has a Common Name ({cn}), "
             "which etcd's JSON gateway refuses once its users are on (certificates of `phoenixft certs` have none)")
        return
    creds = job_credentials(job_prefix, token)
    assert creds is not None
    try:
        local.restrict(job_prefix, *creds)
    except RuntimeError as e:
        local.stop()
        raise UserError(f"--control-plane=etcd: could not limit the local cluster to the job's prefix ({e})") from None


def connect(addr: str, timeout_s: float = 30.0, tls: TlsFiles | None = None, token: str | None = None) -> Store:
    """A new client of the store at `addr`: `HOST:PORT` (a TCPStore) or an `etcd://` URL; each
    blocking call waits at most `timeout_s`. An etcd cluster is spoken to over HTTPS with the client
    certificate `tls`, or the one this process's environment names (`tls.TLS_ENV`: handed down by a
    launcher or an agent started with --tls-*), and, if it asks, as the job's etcd user
    (`etcd_store.job_credentials`, from `token` or the one in this process's environment); a TCPStore
    address is always plain (with TLS it is the loopback address of the store itself, or of this host's
    forwarder)."""
    if describe(addr).replicated:
        eps, prefix = parse_etcd_url(addr)
        count_opened()
        files = tls or tls_from_env()
        prefix = prefix or "/phoenixft/default"
        creds = job_credentials(prefix, token or os.environ.get(TOKEN_ENV, ""))
        return EtcdStore(eps, prefix, timeout_s, files.client_context() if files else None, creds)
    host, port = addr.rsplit(":", 1)
    return tcp_client(host, int(port), timeout_s)
