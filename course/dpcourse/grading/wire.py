"""Frames of JSON and raw tensor bytes: how a rank and the grader's message router talk.

Why not pickle: the grader reads what ranks send, and ranks run learner code, so nothing a rank
writes may be able to run code in the grader. A frame is a JSON header (numbers, strings, lists)
followed by the raw bytes of its tensors; `read_frame` rebuilds plain `torch.Tensor`s of the
announced dtypes and shapes and nothing else. Used by `dpcourse.grading.routed` (inside ranks
while grading) and the grader's router.
"""

import json
import struct

import torch

DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)}
MAX_FRAME = 1 << 30  # a single message larger than 1 GiB is refused
HEADER = struct.Struct("<II")  # a frame's first 8 bytes: the lengths of its JSON header and of its body


class WireError(Exception):
    """A frame that does not follow the protocol (truncated, oversized, malformed)."""


def encode(header, tensors=()):
    """One frame: 8-byte lengths, the JSON header, then each tensor's bytes (contiguous, CPU)."""
    blobs, specs = [], []
    for t in tensors:
        t = t.detach().to("cpu")
        if str(t.dtype).removeprefix("torch.") not in DTYPES:
            raise TypeError(f"tensors of dtype {t.dtype} cannot be sent while grading")
        dense = torch.empty(t.shape, dtype=t.dtype).copy_(t).reshape(-1)  # standard strides
        blob = dense.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        specs.append([str(t.dtype).removeprefix("torch."), list(t.shape), len(blob)])
        blobs.append(blob)
    head = json.dumps(dict(header, tensors=specs)).encode()
    body = b"".join(blobs)
    return HEADER.pack(len(head), len(body)) + head + body


def decode(head, body):
    """(header dict, [tensors]) from the two parts of a frame, validating every field."""
    try:
        header = json.loads(head)
    except ValueError as exc:
        raise WireError(f"malformed header: {exc}") from None
    if not isinstance(header, dict) or not isinstance(header.get("tensors", []), list):
        raise WireError("malformed header")
    tensors, offset = [], 0
    for spec in header.pop("tensors", []):
        if (not isinstance(spec, list) or len(spec) != 3 or spec[0] not in DTYPES
                or not all(isinstance(n, int) and n >= 0 for n in spec[1]) or not isinstance(spec[2], int)):
            raise WireError(f"malformed tensor description {spec!r}")
        dtype, shape, nbytes = DTYPES[spec[0]], spec[1], spec[2]
        numel = 1
        for n in shape:
            numel *= n
        if nbytes != numel * torch.empty((), dtype=dtype).element_size() or offset + nbytes > len(body):
            raise WireError(f"tensor of shape {shape} and dtype {spec[0]} does not match its {nbytes} bytes")
        raw = bytearray(body[offset:offset + nbytes])
        offset += nbytes
        flat = torch.frombuffer(raw, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
        tensors.append(flat.view(dtype).reshape(shape) if nbytes else torch.empty(shape, dtype=dtype))
    if offset != len(body):
        raise WireError("frame has bytes no tensor claims")
    return header, tensors


def read_exact(sock, n):
    """Exactly n bytes from a socket, or None if it closed first.

    The buffer grows with what really arrives (doubling from 1 MiB, never past n), not with what
    a length field announced: a peer that announces a huge frame and sends little costs little.
    """
    buf, got = bytearray(min(n, 1 << 20)), 0
    while got < n:
        if got == len(buf):
            buf.extend(bytes(min(len(buf), n - len(buf))))
        k = sock.recv_into(memoryview(buf)[got:])
        if not k:
            return None
        got += k
    return bytes(buf)


class FrameTooLarge(WireError):
    """A frame over the reader's limit; `header` is its header (read, small) when it could be read."""

    def __init__(self, message, header=None):
        super().__init__(message)
        self.header = header


def read_frame(sock, limit=MAX_FRAME):
    """(header, tensors) from a socket; None when the peer closed the connection.

    limit: the largest body accepted. A larger one raises FrameTooLarge before any of its body is
    read (with the header, so that the reader can answer the request it belonged to).
    """
    lengths = read_exact(sock, HEADER.size)
    if lengths is None:
        return None
    head_len, body_len = HEADER.unpack(lengths)
    if head_len > 1 << 20:
        raise WireError(f"frame header too large ({head_len} bytes)")
    head = read_exact(sock, head_len)
    if head is None:
        return None
    if body_len > limit:
        try:
            header = json.loads(head)
        except ValueError:
            header = None
        raise FrameTooLarge(f"a message of {body_len} bytes, more than the {limit} bytes allowed",
                            header if isinstance(header, dict) else None)
    body = read_exact(sock, body_len) if body_len else b""
    if body is None:
        return None
    return decode(head, body)


# -- plain values: what a graded rank may return -------------------------------------------------

def encode_value(value):
    """A frame holding a plain value: None, bool, int, float, str, tensors and lists, tuples and
    dicts of these. Anything else (a module, a learner's object) raises TypeError with its type."""
    tensors = []
    tree = _tree(value, tensors, depth=0)
    return encode({"value": tree}, tensors)


def read_value(sock, limit=MAX_FRAME):
    """A plain value from a socket (a frame written by `encode_value`); None if it closed."""
    frame = read_frame(sock, limit)
    if frame is None:
        return None
    header, tensors = frame
    return _untree(header.get("value"), tensors)


def decode_value(head, body):
    header, tensors = decode(head, body)
    return _untree(header.get("value"), tensors)


def decode_value_frame(data):
    """A plain value from one whole frame held in memory (a rank's report)."""
    if len(data) < HEADER.size:
        raise WireError("truncated frame")
    head_len, body_len = HEADER.unpack(data[:HEADER.size])
    head = data[HEADER.size:HEADER.size + head_len]
    return decode_value(head, data[HEADER.size + head_len:HEADER.size + head_len + body_len])


def _tree(value, tensors, depth):
    if depth > 50:
        raise TypeError("the value is nested more than 50 levels deep")
    if value is None or type(value) in (bool, int, str):
        return [type(value).__name__ if value is not None else "none", value]
    if type(value) is float:
        return ["float", repr(value)]
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return ["tensor", len(tensors) - 1]
    if type(value) in (list, tuple):
        return [type(value).__name__, [_tree(v, tensors, depth + 1) for v in value]]
    if isinstance(value, dict):  # dict, OrderedDict (a state_dict): returned as a plain dict
        return ["dict", [[_tree(k, tensors, depth + 1), _tree(v, tensors, depth + 1)]
                         for k, v in value.items()]]
    if type(value).__module__ == "torch" and type(value).__name__ in ("dtype", "device", "Size"):
        return ["str", str(value)] if type(value).__name__ != "Size" else ["tuple", [
            ["int", int(n)] for n in value]]
    raise TypeError(f"a value of type {type(value).__module__}.{type(value).__qualname__} cannot be "
                    f"returned from a graded rank (plain values only: numbers, strings, tensors, "
                    f"lists, tuples, dicts)")


def _untree(node, tensors):
    if not isinstance(node, list) or len(node) != 2 or not isinstance(node[0], str):
        raise WireError(f"malformed value {node!r:.80}")
    kind, payload = node
    if kind == "none":
        return None
    if kind in ("bool", "int", "str"):
        if type(payload) is not {"bool": bool, "int": int, "str": str}[kind]:
            raise WireError(f"malformed {kind}")
        return payload
    if kind == "float":
        return float(payload)
    if kind == "tensor":
        if type(payload) is not int or not 0 <= payload < len(tensors):
            raise WireError("malformed tensor reference")
        return tensors[payload]
    if kind in ("list", "tuple"):
        items = [_untree(v, tensors) for v in payload]
        return items if kind == "list" else tuple(items)
    if kind == "dict":
        out = {}
        for pair in payload:
            key = _untree(pair[0], tensors)
            if isinstance(key, (list, dict, torch.Tensor)):
                raise WireError("unhashable dict key")
            out[key] = _untree(pair[1], tensors)
        return out
    raise WireError(f"unknown value kind {kind!r}")
