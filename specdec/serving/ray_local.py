"""The local Ray instance of `specdec serve --ray`: its control plane kept on loopback, behind a token, and checked.

Ray has no option that binds its services to loopback on Linux: `ray.init(_node_ip_address="127.0.0.1")` is turned
into the machine's address (`ray._private.services.resolve_ip_for_localhost`), the node registers under it, and the
GCS, raylet, workers, agents and the Serve controller listen on every interface or on that address. On macOS and
Windows, where Ray runs single-node instances only, it gives the node the loopback address and every server binds
that; `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, read when `ray` is imported, asks for the same on Linux. So the
environment of `local_ray_env` is set before the first `import ray`, and once the replicas run, `refuse_exposed`
checks the listening sockets of every process of the instance (`listeners`, from /proc), and the node's address.

Ray's token authentication (`RAY_AUTH_MODE=token`) makes its RPC and HTTP entry points ask for a shared token; the
instance gets one of its own in `RAY_AUTH_TOKEN` (inherited by its processes, never written to ~/.ray/auth_token),
unless the environment names one already (`RAY_AUTH_TOKEN` or `RAY_AUTH_TOKEN_PATH`).
"""
from __future__ import annotations

import ipaddress
import os
import secrets
import sys
from contextlib import contextmanager
from dataclasses import dataclass

from specdec.errors import ExposureError

LOOPBACK = "127.0.0.1"
LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": the node's address is loopback (ray_constants)
AUTH_MODE_ENV = "RAY_AUTH_MODE"
TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
LOCAL_SETTINGS = {LOCAL_ONLY_ENV: "0", AUTH_MODE_ENV: "token"}  # read by Ray when it is imported
TCP_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
WILDCARD_HOSTS = frozenset({"[::]", "::", "0.0.0.0", ""})  # an address binding every interface
TCP_LISTEN = 0x0A  # the kernel's TCP_LISTEN in a table's `st` column


@contextmanager
def local_ray_env():
    """Ray's environment for a local instance on loopback with token authentication, while the block runs (Ray's
    processes inherit it); the variables are restored after. Enter it before `ray` is first imported: where it was
    imported under other settings, Ray has read them already (its node would take the machine's address, and its
    driver would ask a GCS that wants a token for none), so that is refused (ExposureError) before Ray starts."""
    _refuse_imported_ray()
    wanted = dict(LOCAL_SETTINGS)
    if not (os.environ.get(TOKEN_ENV) or os.environ.get(TOKEN_PATH_ENV)):
        wanted[TOKEN_ENV] = secrets.token_hex(32)  # as `ray get-auth-token --generate` makes one
    saved = {name: os.environ.get(name) for name in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _refuse_imported_ray() -> None:
    """ExposureError where `ray` is imported already and the environment lacks LOCAL_SETTINGS."""
    seen = {name: os.environ.get(name) for name in LOCAL_SETTINGS}
    differ = [f"{name}={value}" for name, value in seen.items() if value != LOCAL_SETTINGS[name]]
    if sys.modules.get("ray") is None or not differ:
        return
    wanted = " ".join(f"{name}={value}" for name, value in LOCAL_SETTINGS.items())
    raise ExposureError("ray was imported before specdec could keep its local instance on loopback "
                        f"({', '.join(differ)})",
                        "start it from a process that has not imported ray (`specdec serve --ray` as its own command), "
                        f"or set {wanted} before importing ray")


def replica_grpc_on_loopback() -> None:
    """In a replica of a node registered under loopback, bind Serve's inter-deployment gRPC server to loopback too.

    Ray Serve 2.60 binds that server, which every replica starts, to "[::]:0" (every interface) whatever the node's
    address, and no option sets it (ray-project/ray#64544). On a loopback node nothing beyond this machine can reach
    the replica anyway, so the bind is rewritten, through Serve's own helper (RAY_USE_TLS still honoured); call this
    in the replica process before the server starts (Serve starts it once the deployment's callable is built). Where
    a Ray version binds elsewhere, `refuse_exposed` still catches it."""
    import ray
    from ray.serve._private import replica as serve_replica

    bind, node = serve_replica.add_port_to_grpc_server, ray.util.get_node_ip_address()
    if getattr(bind, "on_loopback", False) or not is_loopback(node):
        return
    node_host = f"[{node}]" if ipaddress.ip_address(node).version == 6 else node

    def bind_on_loopback(server, address: str) -> int:
        host, _, port = address.rpartition(":")
        return bind(server, f"{node_host}:{port}" if host in WILDCARD_HOSTS else address)

    bind_on_loopback.on_loopback = True
    serve_replica.add_port_to_grpc_server = bind_on_loopback


def is_loopback(address: str) -> bool:
    """Whether an IP address is this machine only: 127.0.0.0/8, ::1, or IPv4 loopback mapped into IPv6."""
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


@dataclass(frozen=True)
class Listener:
    """A listening TCP socket of a process."""

    pid: int
    process: str  # /proc/PID/comm: gcs_server, raylet, ray::ServeController ...
    address: str  # as `ss` prints it: 127.0.0.1, ::ffff:127.0.0.1, 0.0.0.0, :: ...
    port: int

    def __str__(self) -> str:
        host = f"[{self.address}]" if ipaddress.ip_address(self.address).version == 6 else self.address
        return f"{self.process} (pid {self.pid}) on {host}:{self.port}"


def listeners(pids) -> list[Listener]:
    """The listening TCP sockets, IPv4 and IPv6, of the processes `pids` (Linux: /proc; a process gone or not
    readable has none)."""
    owner = {inode: pid for pid in pids for inode in _socket_inodes(pid)}
    found = []
    for table in TCP_TABLES:
        for address, port, inode in _listening(table):
            if inode in owner:
                found.append(Listener(owner[inode], _process_name(owner[inode]), address, port))
    return found


def refuse_exposed(node_address: str, found: list[Listener], api_port: int | None = None) -> None:
    """Raise ExposureError unless the node's address and every listener of `found` are loopback; a listener on
    `api_port` may be elsewhere (a --host that is not loopback: the operator exposes the API, not Ray)."""
    hint = ("specdec stopped the instance. Run `specdec serve --ray` in a process that has not imported ray before "
            f"(specdec sets {LOCAL_ONLY_ENV}=0, which Ray reads at import), and see the Serving docs, 'Ray's control "
            "plane'")
    if not is_loopback(node_address):
        raise ExposureError(f"the local Ray instance registered its node under {node_address}, not loopback", hint)
    exposed = [listener for listener in found if not is_loopback(listener.address) and listener.port != api_port]
    if exposed:
        raise ExposureError("the local Ray instance listens beyond loopback: "
                            + "; ".join(str(listener) for listener in exposed), hint)


def can_list() -> bool:
    """Whether this system shows the sockets `listeners` reads (Linux)."""
    return all(os.access(table, os.R_OK) for table in TCP_TABLES)


def _socket_inodes(pid: int) -> set:
    """The inodes of the sockets process `pid` holds open (its /proc/PID/fd links `socket:[INODE]`)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return set()
    inodes = set()
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:["):-1]))
    return inodes


def _listening(table: str) -> list:
    """(address, port, inode) of each listening socket of a /proc/net/tcp{,6} table; [] where it cannot be read."""
    try:
        with open(table, encoding="ascii") as handle:
            rows = handle.read().splitlines()[1:]
    except OSError:
        return []
    found = []
    for row in rows:
        fields = row.split()
        if len(fields) > 9 and int(fields[3], 16) == TCP_LISTEN:
            address, port = fields[1].split(":")
            found.append((_address_from_hex(address), int(port, 16), int(fields[9])))
    return found


def _address_from_hex(text: str) -> str:
    """An address of /proc/net/tcp{,6}: 32-bit words in host byte order, 1 of them for IPv4, 4 for IPv6."""
    raw = b"".join(int(text[i:i + 8], 16).to_bytes(4, sys.byteorder) for i in range(0, len(text), 8))
    ip = ipaddress.ip_address(raw)
    mapped = getattr(ip, "ipv4_mapped", None)
    return f"::ffff:{mapped}" if mapped is not None else str(ip)  # as `ss` prints it, not ::ffff:7f00:1


def _process_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as handle:
            return handle.read().strip()
    except OSError:
        return "?"
