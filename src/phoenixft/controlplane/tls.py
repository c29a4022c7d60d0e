"""TLS for the control plane: mutual authentication from a job CA, with Python's `ssl` only.

A TCPStore speaks plain TCP and authenticates nobody. With `--tls-cert/--tls-key/--tls-ca` the
job's store listens on loopback only and every other host reaches it through TLS:

- the head's store front (`controlplane/front.py`) listens on the head's `--host:--port` as a **gateway**:
  it accepts TLS connections whose client presents a certificate signed by the job CA, and relays each to
  the store. The store's bytes are opened only after the handshake succeeded, so a peer without such a
  certificate never reaches the store;
- each agent runs a **forwarder** (`start_forwarder`): a process listening on a free loopback port
  of its host that accepts only connections of its own user (the owner of the connecting socket is
  found by the kernel from the connection's exact four-tuple: controlplane/peers.py) and relays each
  through a new TLS connection to the gateway, verifying
  the gateway's certificate against the job CA. The agent and the workers it forks use the
  forwarder's address as the store's, so torch's TCPStore client and gloo's rendezvous (which runs
  through the store) work unchanged.

Identity is "holds a certificate and key signed by the job CA" (no host-name check: one CA per
job, made by `phoenixft certs`). Both relays are `controlplane/tlsproxy.py` processes (a script:
no torch to import) that die with the process that started them.

`TlsFiles.check()` is what every command does with the three flags: a one-line UserError for a
missing or unreadable file, a key file others can read, a certificate that does not go with its key
or is not signed by the CA. `TLS_ENV` passes the three paths to the processes a launcher or an agent
starts (an etcd client reads them there).
"""

from __future__ import annotations

import os
import socket
import ssl
import stat
import time
from dataclasses import dataclass

from phoenixft.controlplane.front import Relay, listening, start_relay
from phoenixft.controlplane.tlsproxy import TLS_ENV, client_context, server_context
from phoenixft.errors import UserError

__all__ = ["TlsFiles", "TLS_ENV", "from_env", "start_forwarder", "Relay", "handshake_problem", "probe"]



@dataclass(frozen=True)
class TlsFiles:
    """A host's certificate and key (PEM) and the job CA's certificate that every peer must be signed by."""

    cert: str
    key: str
    ca: str

    def env(self) -> dict[str, str]:
        """The environment that hands these files to a child process (see `from_env`)."""
        return dict(zip(TLS_ENV, (os.path.abspath(self.cert), os.path.abspath(self.key), os.path.abspath(self.ca)),
                        strict=True))

    def args(self) -> list[str]:
        """These files as `--tls-cert/--tls-key/--tls-ca` flags (paths, nothing secret)."""
        return ["--tls-cert", os.path.abspath(self.cert), "--tls-key", os.path.abspath(self.key),
                "--tls-ca", os.path.abspath(self.ca)]

    def common_name(self) -> str:
        """The Common Name of the certificate's subject ("" if it has none, or cannot be read)."""
        try:
            from cryptography import x509
            from cryptography.x509.oid import NameOID

            with open(self.cert, "rb") as f:
                cert = x509.load_pem_x509_certificate(f.read())
            return ",".join(str(a.value) for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME))
        except (OSError, ValueError, ImportError):
            return ""

    def server_context(self) -> ssl.SSLContext:
        """TLS 1.2+ server: presents our certificate, requires one from the job CA."""
        return server_context(self.cert, self.key, self.ca)

    def client_context(self) -> ssl.SSLContext:
        """TLS 1.2+ client: presents our certificate, accepts a server signed by the job CA (any name)."""
        return client_context(self.cert, self.key, self.ca)

    @staticmethod
    def given(cert: str, key: str, ca: str, prefix: str = "--tls") -> TlsFiles | None:
        """The files the three flags name (None if none is given), checked (`check`)."""
        if not (cert or key or ca):
            return None
        missing = [f"{prefix}-{n}" for n, v in (("cert", cert), ("key", key), ("ca", ca)) if not v]
        if missing:
            raise UserError(f"{', '.join(missing)} missing: TLS needs all three of {prefix}-cert, {prefix}-key and "
                            f"{prefix}-ca (make them with `phoenixft certs DIR`)")
        files = TlsFiles(cert, key, ca)
        files.check(prefix)
        return files

    def check(self, prefix: str = "--tls") -> None:
        """UserError (one line naming the flag) unless the files exist, the key is private, the certificate
        goes with the key and is signed by the CA."""
        for name, path in (("cert", self.cert), ("key", self.key), ("ca", self.ca)):
            try:
                st = os.stat(path)
                with open(path, "rb"):
                    pass
            except OSError as e:
                raise UserError(f"{prefix}-{name}={path}: cannot read it ({e.strerror or e})") from None
            if not stat.S_ISREG(st.st_mode):
                raise UserError(f"{prefix}-{name}={path}: not a regular file")
        st = os.stat(self.key)
        if st.st_mode & 0o077 or st.st_uid != os.getuid():
            raise UserError(f"{prefix}-key={self.key}: mode {stat.S_IMODE(st.st_mode):04o}"
                            f"{'' if st.st_uid == os.getuid() else ', not yours'}: a private key must be yours and "
                            f"readable by you only (chmod 600 {self.key})")
        try:
            self.server_context()
        except ssl.SSLError as e:
            raise UserError(f"{prefix}-cert={self.cert} / {prefix}-key={self.key}: not a PEM certificate and "
                            f"its matching key ({e.reason or e})") from None
        try:
            ssl.create_default_context(cafile=self.ca)
        except ssl.SSLError as e:
            raise UserError(f"{prefix}-ca={self.ca}: not a PEM CA certificate ({e.reason or e})") from None
        why = handshake_problem(self, self)
        if why:
            raise UserError(f"{prefix}-cert={self.cert}: does not verify against {prefix}-ca={self.ca} ({why}): "
                            "give a certificate signed by the job's CA")


def handshake_problem(server: TlsFiles, client: TlsFiles) -> str | None:
    """Why a TLS handshake between these two sides fails (None: it succeeds), in memory (no socket)."""
    s_in, s_out, c_in, c_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    s = server.server_context().wrap_bio(s_in, s_out, server_side=True)
    c = client.client_context().wrap_bio(c_in, c_out, server_side=False)
    sides = [(c, c_out, s_in), (s, s_out, c_in)]
    done = {id(c): False, id(s): False}
    for _ in range(20):
        for me, out, peer_in in sides:
            if not done[id(me)]:
                try:
                    me.do_handshake()
                    done[id(me)] = True
                except ssl.SSLWantReadError:
                    pass
                except ssl.SSLError as e:
                    return str(e.reason or e)
            data = out.read()
            if data:
                peer_in.write(data)
        if all(done.values()):
            # a TLS 1.3 server verifies the client's certificate once it reads the client's last flight
            try:
                s.read(1)
            except ssl.SSLWantReadError:
                return None
            except ssl.SSLError as e:
                return str(e.reason or e)
            return None
    return "the handshake did not finish"


def from_env(environ: dict[str, str] | None = None) -> TlsFiles | None:
    """The TLS files a parent handed down in the environment (`TlsFiles.env`), or None."""
    env = os.environ if environ is None else environ
    vals = [env.get(k, "") for k in TLS_ENV]
    return TlsFiles(*vals) if all(vals) else None


def start_forwarder(remote: str, files: TlsFiles) -> Relay:
    """An agent's forwarder: 127.0.0.1:<free port> for this user's processes, TLS to the gateway at `remote`."""
    p = start_relay(["forwarder", "--target", remote], files.env())
    return Relay(p, "127.0.0.1", listening(p, "TLS forwarder"))


def speaks_tls(host: str, port: int, timeout_s: float) -> bool:
    """Whether the server at host:port answers a TLS handshake (a head's TLS gateway does, within a round trip; a
    plain TCPStore waits for its client to speak and says nothing, a plain store's front closes the connection
    on bytes that are not a store request: either, or no answer within `timeout_s` (or ten times the
    connection's own set-up time where that is longer), is no TLS). It is asked without a certificate and
    without checking the server's: the answer says only that it speaks TLS."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    try:
        t0 = time.monotonic()
        with socket.create_connection((host, port), timeout=max(timeout_s, 10.0)) as raw:
            raw.settimeout(max(timeout_s, 10 * (time.monotonic() - t0)))
            with ctx.wrap_socket(raw, server_hostname=host):
                return True
    except (ssl.SSLEOFError, ssl.SSLZeroReturnError):
        return False  # (it closed the connection without a TLS answer: a plain store's front refusing the bytes)
    except ssl.SSLError as e:  # (it answered in TLS, refusing this client; or it answered in something else)
        return e.reason not in ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "UNKNOWN_PROTOCOL")
    except OSError:
        return False


def probe(host: str, port: int, files: TlsFiles, timeout_s: float = 10.0) -> str | None:
    """Why a TLS connection to the gateway at host:port with these files fails (None: it is let in). A
    TLS 1.3 server refuses a client certificate after the client's handshake returned: its alert is read
    here (nothing comes otherwise: the gateway waits for the store's client to speak)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as raw:
            with files.client_context().wrap_socket(raw) as s:
                s.settimeout(0.5)
                try:
                    s.recv(1)
                except TimeoutError:
                    return None
                return "the gateway closed the connection"
    except ssl.SSLError as e:
        return str(e.reason or e)
    except OSError as e:
        return e.strerror or str(e)
