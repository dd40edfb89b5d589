"""Optional ed25519 signatures: a receipt wrapped in a DSSE envelope, as in-toto attestations are.

The digest inside a receipt is a plain sha256: it catches accidental corruption, but anyone who edits
a receipt can recompute it. A signature says who made the receipt: `run --sign KEY` wraps the receipt
file's exact bytes in an envelope

    {"payloadType": PAYLOAD_TYPE, "payload": base64(receipt bytes),
     "signatures": [{"keyid": sha256 of the raw public key, "sig": base64(ed25519(PAE))}]}

where PAE is DSSE's pre-authentication encoding (https://github.com/secure-systems-lab/dsse,
protocol.md): b"DSSEv1 <len(type)> <type> <len(payload)> <payload>". `verify --public-key KEY` checks
the signature, then verifies the receipt inside as usual. Needs the `cryptography` package (extra `sign`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lora_parity.evidence.receipt_io import read_bounded, write_text_atomic
from lora_parity.util import safe_write
from lora_parity.util.errors import BackendUnavailableError, ConfigError, ReceiptError

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

PAYLOAD_TYPE = "application/vnd.lora-parity.receipt+json"
ENVELOPE_KEYS = {"payloadType", "payload", "signatures"}
MAX_KEY_BYTES = 64 * 1024


def _crypto() -> Any:
    try:
        from cryptography.hazmat.primitives import serialization
    except ImportError:
        raise BackendUnavailableError("signing needs the cryptography package: pip install 'lora-parity[sign]'") \
            from None
    return serialization


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE's pre-authentication encoding of a payload: what is signed."""
    kind = payload_type.encode("utf-8")
    return b"DSSEv1 %d %s %d %s" % (len(kind), kind, len(payload), payload)


def keyid(public_key: Ed25519PublicKey) -> str:
    """sha256 hex of the raw 32-byte public key."""
    serialization = _crypto()
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()


def _first_sentence(e: Exception) -> str:
    return str(e).split(". ")[0][:100]


def _read_key(path: Path) -> bytes:
    try:
        return read_bounded(Path(path), MAX_KEY_BYTES)
    except ReceiptError as e:
        raise ConfigError(str(e).replace("a receipt", "a key")) from None


def load_private_key(path: Path) -> Ed25519PrivateKey:
    """An unencrypted ed25519 private key from a PEM file; `ConfigError` (one line) otherwise."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    pem = _read_key(path)
    try:
        key = _crypto().load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{path}: not an unencrypted PEM private key ({_first_sentence(e)})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"{path}: not an ed25519 key (make one with `lora-parity keygen`)")
    return key


def load_public_key(path: Path) -> Ed25519PublicKey:
    """An ed25519 public key from a PEM file; `ConfigError` (one line) otherwise."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    pem = _read_key(path)
    try:
        key = _crypto().load_pem_public_key(pem)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{path}: not a PEM public key ({_first_sentence(e)})") from None
    if not isinstance(key, Ed25519PublicKey):
        raise ConfigError(f"{path}: not an ed25519 public key")
    return key


def envelope(payload: bytes, key: Ed25519PrivateKey) -> dict[str, Any]:
    """`payload` signed with `key`, as a DSSE envelope."""
    return {
        "payloadType": PAYLOAD_TYPE,
        "payload": base64.b64encode(payload).decode("ascii"),
        "signatures": [{"keyid": keyid(key.public_key()),
                        "sig": base64.b64encode(key.sign(pae(PAYLOAD_TYPE, payload))).decode("ascii")}],
    }


def sign_file(path: Path, key: Ed25519PrivateKey) -> Path:
    """Replace the receipt at `path` with its signed envelope; return the path written."""
    payload = read_bounded(Path(path))
    return write_text_atomic(json.dumps(envelope(payload, key), indent=1) + "\n", Path(path), force=True)


def is_envelope(data: Any) -> bool:
    """Whether parsed JSON is a DSSE envelope rather than a bare receipt."""
    return isinstance(data, dict) and "payloadType" in data and "schema_version" not in data


def _b64(text: Any, name: str, what: str) -> bytes:
    if not isinstance(text, str):
        raise ReceiptError(f"{name}: envelope {what} is not a string")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ReceiptError(f"{name}: envelope {what} is not valid base64") from None


def _signatures(data: dict[str, Any], name: str) -> list[bytes]:
    sigs = data["signatures"]
    if not isinstance(sigs, list) or not sigs:
        raise ReceiptError(f"{name}: envelope signatures must be a non-empty list")
    if not all(isinstance(s, dict) and set(s) <= {"keyid", "sig"} and "sig" in s for s in sigs):
        raise ReceiptError(f"{name}: envelope signatures must be objects with sig (and keyid)")
    return [_b64(s["sig"], name, "sig") for s in sigs]


def open_envelope(data: dict[str, Any], name: str, public_key: Ed25519PublicKey | None) -> tuple[bytes, str]:
    """The payload of an envelope, and the signature status: 'valid (keyid …)' when `public_key`
    signed it, 'not checked' without a key. A malformed envelope or a signature that does not
    verify with `public_key` raises `ReceiptError`."""
    if set(data) != ENVELOPE_KEYS:
        raise ReceiptError(f"{name}: an envelope has exactly payloadType, payload and signatures")
    if data["payloadType"] != PAYLOAD_TYPE:
        raise ReceiptError(f"{name}: envelope payloadType is not {PAYLOAD_TYPE}")
    payload = _b64(data["payload"], name, "payload")
    sigs = _signatures(data, name)
    if public_key is None:
        return payload, "not checked"
    from cryptography.exceptions import InvalidSignature

    message = pae(PAYLOAD_TYPE, payload)
    for sig in sigs:
        try:
            public_key.verify(sig, message)
        except InvalidSignature:
            continue
        return payload, f"valid (keyid {keyid(public_key)[:16]})"
    raise ReceiptError(f"{name}: signature does not verify with the given public key")


def keygen(private_path: Path, force: bool = False) -> tuple[Path, Path]:
    """Write a new ed25519 keypair as PEM: the private key at `private_path` (mode 0600, unencrypted)
    and the public key beside it with `.pub` appended; return both paths."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    serialization = _crypto()
    private_path = Path(private_path)
    public_path = private_path.with_name(private_path.name + ".pub")
    for p in (private_path, public_path):
        if p.exists() and not force:
            raise ConfigError(f"{p} exists; pass --force to overwrite it")
        safe_write.check_replaceable(p)  # never into a device, a FIFO or through a link, even with --force
    key = Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
    public_pem = key.public_key().public_bytes(serialization.Encoding.PEM,
                                               serialization.PublicFormat.SubjectPublicKeyInfo)
    try:
        safe_write.write_atomic(private_path, private_pem, mode=0o600)
        try:
            safe_write.write_atomic(public_path, public_pem)
        except BaseException:
            private_path.unlink(missing_ok=True)  # never half a keypair
            raise
    except OSError as e:
        raise ConfigError(f"cannot write the keypair: {e.strerror or e}") from None
    return private_path, public_path
