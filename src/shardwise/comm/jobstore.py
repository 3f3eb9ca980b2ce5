"""The job's own key-value store, open only to processes that hold the job's secret.

torch's `TCPStore` answers anyone who reaches its port, and hands out every key name
(`list_keys`): a job's heartbeats, abort flag and checksums kept there can be read and forged by
any local process. So the ranks of a job started by shardwise say everything they tell each other
outside collectives (gloo's addresses at start-up included) through this store instead: a small
server on 127.0.0.1, hosted by the launcher (or the parameter-server supervisor) so that a frozen
rank freezes nobody's requests, and a client in each rank that is a c10d `Store` (so
`init_process_group` rendezvouses through it too).

A connection proves, before its first request, that it holds the secret (HMAC-SHA256 over a fresh
random challenge each way: the secret never crosses the wire, a recorded answer is worth
nothing), or is closed. Requests are frames of validated lengths; no request blocks the server
(a wait is the client polling `check`), so one slow client delays no other.

The secret reaches the ranks in their environment (`SHARDWISE_JOB_TOKEN`, readable only by the
same user and root), the address in `SHARDWISE_JOB_STORE`.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import socketserver
import struct
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from shardwise.comm.store import wait_for

ADDRESS_ENV = "SHARDWISE_JOB_STORE"  # host:port of the job's store
SECRET_ENV = "SHARDWISE_JOB_TOKEN"  # the job's secret (hex)
HOST = "127.0.0.1"

NONCE = 32
MAX_KEY = 4096  # bytes of a key name
MAX_VALUE = 64 << 20  # bytes of a value (gloo's addresses, heartbeats, stacks: far less)
MAX_CONNECTIONS = 1024
HANDSHAKE_TIMEOUT_S = 5.0  # the whole proof, from the challenge on

# Operations (one byte) and answers.
SET, GET, ADD, CHECK, COMPARE_SET, DELETE, NUM_KEYS = range(1, 8)
OK, MISSING, REFUSED = 0, 1, 2
_REQUEST = struct.Struct("!BII")  # op, key length, value length
_ANSWER = struct.Struct("!BI")  # status, value length


class JobStoreError(RuntimeError):
    """The store refused a request, or could not be reached; the message says which."""


def _proof(secret: bytes, role: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, role + nonce, hashlib.sha256).digest()


def _read_exactly(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """`n` bytes; by `deadline` (monotonic), if given, however slowly they come."""
    chunks, left = [], n
    while left:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("too slow")
            sock.settimeout(remaining)
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("connection closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


# ---- the server ---------------------------------------------------------------------------------
class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        sock: socket.socket = self.request
        if not self.server.admit():
            return
        try:
            if not self._handshake(sock):
                return
            sock.settimeout(None)
            while True:
                op, key_len, value_len = _REQUEST.unpack(_read_exactly(sock, _REQUEST.size))
                if key_len > MAX_KEY or value_len > MAX_VALUE:
                    return  # a client that sends this is not ours: drop it
                key = _read_exactly(sock, key_len)
                value = _read_exactly(sock, value_len)
                status, answer = self.server.apply(op, key, value)
                sock.sendall(_ANSWER.pack(status, len(answer)) + answer)
        except (OSError, ConnectionError, struct.error):
            return
        finally:
            self.server.release()

    def _handshake(self, sock: socket.socket) -> bool:
        secret = self.server.secret
        challenge = secrets.token_bytes(NONCE)
        sock.settimeout(HANDSHAKE_TIMEOUT_S)
        sock.sendall(challenge)
        # (in all, however it is trickled: a slot is not held for long without the secret)
        answer = _read_exactly(sock, 2 * NONCE, time.monotonic() + HANDSHAKE_TIMEOUT_S)
        proof, theirs = answer[:NONCE], answer[NONCE:]
        if not hmac.compare_digest(proof, _proof(secret, b"client", challenge)):
            return False
        sock.sendall(_proof(secret, b"server", theirs))
        return True


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = False

    def __init__(self, address: tuple[str, int], secret: bytes) -> None:
        super().__init__(address, _Handler)
        self.secret = secret
        self.data: dict[bytes, bytes] = {}
        self.lock = threading.Lock()
        self._connections = 0

    def admit(self) -> bool:
        with self.lock:
            if self._connections >= MAX_CONNECTIONS:
                return False
            self._connections += 1
            return True

    def release(self) -> None:
        with self.lock:
            self._connections -= 1

    def apply(self, op: int, key: bytes, value: bytes) -> tuple[int, bytes]:
        with self.lock:
            return _apply(self.data, op, key, value)


def _apply(data: dict[bytes, bytes], op: int, key: bytes, value: bytes) -> tuple[int, bytes]:
    """One request on the store's data (the caller holds its lock)."""
    if op == SET:
        data[key] = value
        return OK, b""
    if op == GET:
        return (OK, data[key]) if key in data else (MISSING, b"")
    if op == ADD:
        try:
            total = int(data.get(key, b"0")) + int(value)
        except ValueError:
            return REFUSED, b"not an integer"
        data[key] = str(total).encode()
        return OK, data[key]
    if op == CHECK:
        keys = value.split(b"\0") if value else []
        return OK, b"1" if all(k in data for k in keys) else b"0"
    if op == COMPARE_SET:
        # value: the expected value's length (4 bytes), the expected value, the desired one
        if len(value) < 4 or 4 + struct.unpack("!I", value[:4])[0] > len(value):
            return REFUSED, b"malformed compare_set"
        split = 4 + struct.unpack("!I", value[:4])[0]
        expected, desired = value[4:split], value[split:]
        current = data.get(key)
        if (current is None and expected == b"") or current == expected:
            data[key] = desired
            return OK, desired
        return OK, current if current is not None else expected
    if op == DELETE:
        return OK, b"1" if data.pop(key, None) is not None else b"0"
    if op == NUM_KEYS:
        return OK, str(len(data)).encode()
    return REFUSED, b"unknown operation"


class JobStoreServer:
    """The store's server, in a thread of this process, on `host` (127.0.0.1) and a free port."""

    def __init__(self, secret: str, host: str = HOST) -> None:
        self._server = _Server((host, 0), bytes.fromhex(secret))
        self.secret = secret
        self.host, self.port = host, self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True
        )
        self._thread.start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def environment(self) -> dict[str, str]:
        """What a rank needs to reach the store (for its environment)."""
        return {ADDRESS_ENV: self.address, SECRET_ENV: self.secret}

    def read(self, key: str) -> bytes | None:
        """A key's value, read in this process (the launcher reading what a rank left)."""
        with self._server.lock:
            return self._server.data.get(key.encode())

    def write(self, key: str, value: str) -> None:
        """Set a key from this process (the launcher telling the ranks one of them is gone)."""
        with self._server.lock:
            self._server.data[key.encode()] = value.encode()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> JobStoreServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def new_secret() -> str:
    return secrets.token_hex(32)


# ---- the client ---------------------------------------------------------------------------------
def _bytes(value) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    return bytes(value)  # (a list of ints, as c10d passes a byte vector)


class JobStoreClient(dist.Store):
    """A rank's connection to the job's store: a c10d `Store`, usable by `init_process_group`,
    `PrefixStore` and shardwise's own keys alike. Thread-safe: each request holds the one
    connection only for its round trip (waits poll, so a waiting thread never holds it)."""

    def __init__(self, address: str, secret: str, timeout_s: float = 300.0) -> None:
        super().__init__()
        host, _, port = address.rpartition(":")
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._broken = ""  # why the connection can no longer be used
        self._sock = self._connect(host, int(port), bytes.fromhex(secret))

    @classmethod
    def from_environment(cls, timeout_s: float = 300.0) -> JobStoreClient:
        return cls(os.environ[ADDRESS_ENV], os.environ[SECRET_ENV], timeout_s)

    def _connect(self, host: str, port: int, secret: bytes) -> socket.socket:
        deadline = time.monotonic() + min(self._timeout_s, 60.0)
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=HANDSHAKE_TIMEOUT_S)
                break
            except OSError as e:
                if time.monotonic() > deadline:
                    raise JobStoreError(f"the job's store at {host}:{port}: {e}") from None
                time.sleep(0.1)
        try:
            challenge = _read_exactly(sock, NONCE)
        except (OSError, ConnectionError):
            sock.close()
            raise JobStoreError(
                f"the job's store at {host}:{port} closed the connection before its challenge "
                f"(over {MAX_CONNECTIONS} connections to it?)"
            ) from None
        try:
            mine = secrets.token_bytes(NONCE)
            sock.sendall(_proof(secret, b"client", challenge) + mine)
            proof = _read_exactly(sock, NONCE)
        except (OSError, ConnectionError):
            sock.close()
            raise JobStoreError(
                f"the job's store at {host}:{port} refused this process (wrong job secret?)"
            ) from None
        if not hmac.compare_digest(proof, _proof(secret, b"server", mine)):
            sock.close()
            raise JobStoreError(f"{host}:{port} is not this job's store (it failed its proof)")
        # A request answers at once (nothing waits on the server): one that does not within the
        # job's timeout finds its launcher frozen or gone.
        sock.settimeout(self._timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _request(self, op: int, key: str = "", value: bytes = b"") -> tuple[int, bytes]:
        raw_key = key.encode()
        if len(raw_key) > MAX_KEY or len(value) > MAX_VALUE:
            raise JobStoreError(f"a store request over the size limits (key {key[:80]!r})")
        with self._lock:
            if self._broken:
                raise JobStoreError(f"the job's store is unreachable: {self._broken}")
            try:
                self._sock.sendall(_REQUEST.pack(op, len(raw_key), len(value)) + raw_key + value)
                status, length = _ANSWER.unpack(_read_exactly(self._sock, _ANSWER.size))
                answer = _read_exactly(self._sock, length)
            except BaseException as e:
                # A request cut off midway (an error, a timeout, Ctrl-C) leaves the stream out of
                # step: no later request may read its answer.
                self._broken = f"{type(e).__name__}: {e}"
                self._sock.close()
                if isinstance(e, (OSError, ConnectionError)):
                    raise JobStoreError(f"the job's store is unreachable: {e}") from None
                raise
        if status == REFUSED:
            raise JobStoreError(f"the job's store refused a request: {answer.decode()}")
        return status, answer

    # ---- the c10d Store interface
    def set(self, key: str, value) -> None:
        self._request(SET, key, _bytes(value))

    def get(self, key: str) -> bytes:
        self.wait([key])
        status, value = self._request(GET, key)
        if status == MISSING:
            raise JobStoreError(f"key {key!r} vanished from the job's store")
        return value

    def add(self, key: str, value: int) -> int:
        return int(self._request(ADD, key, str(int(value)).encode())[1])

    def compare_set(self, key: str, expected, desired) -> bytes:
        expected, desired = _bytes(expected), _bytes(desired)
        packed = struct.pack("!I", len(expected)) + expected + desired
        return self._request(COMPARE_SET, key, packed)[1]

    def check(self, keys: list[str]) -> bool:
        if any("\0" in k for k in keys):
            raise JobStoreError("a key name with a NUL byte")
        return self._request(CHECK, value="\0".join(keys).encode())[1] == b"1"

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        # (polling `check`: a waiting thread never holds the connection: `comm/store.py`)
        limit = self._timeout_s if timeout is None else timeout.total_seconds()
        try:
            wait_for(self, keys, limit)
        except TimeoutError as e:
            raise JobStoreError(str(e)) from None

    def delete_key(self, key: str) -> bool:
        return self._request(DELETE, key)[1] == b"1"

    def num_keys(self) -> int:
        return int(self._request(NUM_KEYS)[1])

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout_s = timeout.total_seconds()
        self._sock.settimeout(self._timeout_s)

    def close(self) -> None:
        with self._lock:
            self._sock.close()
