"""TLS files renewed in place, as cert-manager renews a Secret mounted in a pod: read again once they change.

`Renewal` holds the files in use and answers, cheaply, whether they were renewed: it stats them
(device, inode, size and modification time, through symlinks) and reads them again only when one of
those changed. Following the links matters in Kubernetes, where each file of a Secret volume is a link
through `..data` and the kubelet renews them all at once by swapping `..data` for a new folder: the
files then have new inodes. A renewal caught half-way (a key that is not the certificate's, a file
missing, unreadable or cut short) is not taken: the files in use stay in use, one warning names the
file, and the files are read again at each question until they are whole.

Servers ask at each new TLS handshake (`fedse.security.admission.server_credentials` gives gRPC's dynamic
credentials a fetcher built on it); clients before each call (`RenewingChannel`). Connections already
open keep the certificates they were made with.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import threading
import weakref
from typing import Any, Callable, NamedTuple

import grpc
from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization

from fedse.config import ConfigError
from fedse.transport.serving import log_fields

log = logging.getLogger("fedse.security.admission")


def read_file(flag: str, path: str) -> bytes:
    try:
        return pathlib.Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot read it ({exc.strerror or exc}); check the path and its "
                          f"permissions") from None


def read_pem(flag: str, path: str) -> bytes:
    data = read_file(flag, path)
    if b"-----BEGIN " not in data:
        raise ConfigError(f"{flag} {path} is not a PEM file (no '-----BEGIN' line)")
    return data


class Pem(NamedTuple):
    """The contents of TLS files; b"" for a file not given."""

    ca: bytes
    cert: bytes
    key: bytes


def _stat(path: str) -> tuple[int, int, int, int] | None:
    try:
        st = os.stat(path)  # follows symlinks: a swapped `..data` shows as another inode
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _certificates(flag: str, path: str, data: bytes) -> list[x509.Certificate]:
    try:
        return x509.load_pem_x509_certificates(data)
    except ValueError as exc:
        raise ConfigError(f"{flag} {path}: not a whole PEM certificate ({exc})") from None


def public_bytes(key: Any) -> bytes:
    """A public key's DER bytes, to compare two keys."""
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


@dataclasses.dataclass(frozen=True)
class TlsFiles:
    """PEM file paths; all empty means TLS off."""

    ca: str = ""
    cert: str = ""
    key: str = ""

    @property
    def enabled(self) -> bool:
        return bool(self.ca or self.cert or self.key)

    def _named(self) -> tuple[tuple[str, str], ...]:
        return ("--tls-ca", self.ca), ("--tls-cert", self.cert), ("--tls-key", self.key)

    def stamp(self) -> tuple:
        """What changes when a file is renewed, without reading it: device, inode, size and
        modification time of each (through symlinks); None for a file not given or not there."""
        return tuple(_stat(path) if path else None for _, path in self._named())

    def read(self) -> Pem:
        """The files' bytes (ConfigError naming a file that cannot be read or is not PEM)."""
        return Pem(*(read_pem(flag, path) if path else b"" for flag, path in self._named()))

    def check(self, pem: Pem) -> x509.Certificate | None:
        """Whether `pem` is a whole set: certificates that parse and a key that is the certificate's
        (ConfigError naming the file otherwise). Returns the certificate, None without one."""
        if pem.ca:
            _certificates("--tls-ca", self.ca, pem.ca)
        if not pem.cert:
            return None
        leaf = _certificates("--tls-cert", self.cert, pem.cert)[0]
        if pem.key:
            try:
                key = serialization.load_pem_private_key(pem.key, password=None)
            except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
                raise ConfigError(f"--tls-key {self.key}: not a whole private key without a password "
                                  f"({exc})") from None
            if public_bytes(key.public_key()) != public_bytes(leaf.public_key()):
                raise ConfigError(f"--tls-key {self.key} is not the private key of the certificate in "
                                  f"--tls-cert {self.cert}: give the key the certificate was issued for")
        return leaf

    def load(self) -> Pem:
        """The files' bytes, read and checked."""
        pem = self.read()
        self.check(pem)
        return pem


class Renewal:
    """TLS files in use (`pem`, read and checked at creation: ConfigError stops the process) and
    whether they were renewed since. Thread-safe."""

    def __init__(self, files: TlsFiles):
        self.files = files
        self._lock = threading.Lock()
        self._stamp = files.stamp()  # before reading: a change while reading shows at the next question
        self.pem = files.load()
        self._refused: Pem | None = None  # the last files found changed but not whole
        self._problem = ""  # what the last warning said; files are read again while it stands

    def renewed(self) -> Pem | None:
        """The files' new contents when they changed since last read and are whole (then in use);
        None otherwise. A stat of each file when nothing changed."""
        with self._lock:
            stamp = self.files.stamp()
            if stamp == self._stamp and not self._problem:
                return None
            self._stamp = stamp
            try:
                pem = self.files.read()
            except ConfigError as exc:
                return self._refuse(None, exc)
            if pem == self.pem:  # touched, or put back as it was
                self._refused, self._problem = None, ""
                return None
            if pem == self._refused:
                return None
            try:
                leaf = self.files.check(pem)
            except ConfigError as exc:
                return self._refuse(pem, exc)
            self.pem, self._refused, self._problem = pem, None, ""
        fields = {"serial": f"{leaf.serial_number:x}", "not_after": leaf.not_valid_after_utc.isoformat()} \
            if leaf is not None else {}
        log.info("TLS files renewed: new connections use them",
                 extra=log_fields(cert=self.files.cert, ca=self.files.ca, **fields))
        return pem

    def _refuse(self, pem: Pem | None, exc: ConfigError) -> None:
        self._refused = pem
        if str(exc) != self._problem:
            self._problem = str(exc)
            log.warning("renewed TLS files not taken, the ones in use stay: a file is missing, cut short or "
                        "does not match", extra=log_fields(problem=self._problem))
        return None


class _MultiCallable:
    """A stub's method on a RenewingChannel: each invocation goes over the channel in use then."""

    def __init__(self, owner: "RenewingChannel", kind: str, args: tuple, kwargs: dict):
        self._owner, self._kind, self._args, self._kwargs = owner, kind, args, kwargs

    def make(self, channel: grpc.Channel) -> Any:
        return getattr(channel, self._kind)(*self._args, **self._kwargs)

    def __call__(self, *args, **kwargs):
        return self._owner.bound(self)(*args, **kwargs)

    def with_call(self, *args, **kwargs):
        return self._owner.bound(self).with_call(*args, **kwargs)

    def future(self, *args, **kwargs):
        return self._owner.bound(self).future(*args, **kwargs)


class RenewingChannel(grpc.Channel):
    """A client channel that follows renewed TLS files: before each call it asks its Renewal, and once
    the files were renewed it opens a new channel from them (`open_channel(pem)`) for that call and
    the ones after. The channel replaced is dropped, not closed, so that calls still running on it
    (a stream, another thread's call) go on to their end; gRPC closes a channel nothing holds once its
    last call ends. close() closes the channel in use."""

    def __init__(self, renewal: Renewal, open_channel: Callable[[Pem], grpc.Channel]):
        self._renewal = renewal
        self._open = open_channel
        self._lock = threading.Lock()
        self._channel = open_channel(renewal.pem)
        self._callables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._closed = False

    def bound(self, method: _MultiCallable) -> Any:
        """`method` on the channel in use, which is renewed first if the files were."""
        with self._lock:
            pem = None if self._closed else self._renewal.renewed()
            if pem is not None:
                self._channel = self._open(pem)
                self._callables = weakref.WeakKeyDictionary()
            made = self._callables.get(method)
            if made is None:  # made under the lock: registering a method with a channel is not thread-safe
                made = self._callables[method] = method.make(self._channel)
            return made

    def unary_unary(self, *args, **kwargs):
        return _MultiCallable(self, "unary_unary", args, kwargs)

    def unary_stream(self, *args, **kwargs):
        return _MultiCallable(self, "unary_stream", args, kwargs)

    def stream_unary(self, *args, **kwargs):
        return _MultiCallable(self, "stream_unary", args, kwargs)

    def stream_stream(self, *args, **kwargs):
        return _MultiCallable(self, "stream_stream", args, kwargs)

    def subscribe(self, callback, try_to_connect=False):
        with self._lock:
            self._channel.subscribe(callback, try_to_connect)

    def unsubscribe(self, callback):
        with self._lock:
            self._channel.unsubscribe(callback)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._channel.close()

    def __enter__(self) -> "RenewingChannel":
        return self

    def __exit__(self, exc_type, exc_val, exc_tb) -> bool:
        self.close()
        return False


__all__ = ["Pem", "Renewal", "RenewingChannel", "TlsFiles", "read_file", "read_pem"]
