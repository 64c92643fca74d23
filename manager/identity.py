"""What the manager accepts from its callers, checked before anything changes: token ids (integers
only, in ``[0, vocab_size)``), tenant salts (``str`` or ``bytes``) and cache keys, each turned into the
exact bytes that enter a page's identity.

Nothing is coerced: ``1.9``, ``"123"``, ``True`` and integers beyond int64 are refused with a
``TypeError``/``ValueError`` instead of becoming other tokens or other tenants.
"""

import collections.abc
import itertools
import numbers

import numpy as np

#: Default bound on token ids (``0 <= t < DEFAULT_VOCAB_SIZE``); configurable per manager.
DEFAULT_VOCAB_SIZE = 2**31
_INT64_LIMIT = 2**63


def check_vocab_size(vocab_size) -> int:
    """``vocab_size`` as a Python int in ``[1, 2**63]``; ``TypeError``/``ValueError`` otherwise."""
    size = check_int("vocab_size", vocab_size)
    if not 1 <= size <= _INT64_LIMIT:
        raise ValueError(f"vocab_size must be in [1, 2**63], got {size}")
    return size


def check_int(name: str, value) -> int:
    """``value`` as a Python int if it is an integer (Python or numpy, not bool); else ``TypeError``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Integral, np.integer)):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    return int(value)


def token_ids(tokens, vocab_size: int, what: str) -> list:
    """The token ids of ``tokens`` as a list of Python ints, each ``0 <= t < vocab_size``.

    Accepts a sequence of Python/numpy integers or an integer numpy array; a ``str``/``bytes`` (a
    sequence of characters, not of tokens), a set or dict (no order), an iterator (read once, so not
    checkable before use), floats and bools are ``TypeError``s.
    """
    if isinstance(tokens, (str, bytes, bytearray)):
        raise TypeError(f"{what} must be a sequence of integer token ids, got {type(tokens).__name__}")
    if isinstance(tokens, np.ndarray):
        if tokens.dtype.kind not in "iu":
            raise TypeError(f"{what} must hold integer token ids, got an array of {tokens.dtype}")
        if tokens.ndim != 1:
            raise ValueError(f"{what} must be 1-D, got shape {tokens.shape}")
        ids = tokens.tolist()
    elif type(tokens) in (list, tuple) and set(map(type, tokens)) <= {int}:  # the common case, in one pass
        ids = list(tokens)
    elif not isinstance(tokens, collections.abc.Sequence):
        raise TypeError(f"{what} must be a sequence (list, tuple, range or 1-D integer array) of token ids, "
                        f"got {type(tokens).__name__}")
    else:
        ids = [check_int(f"{what}[{i}]", t) for i, t in enumerate(tokens)]
    if ids:
        low, high = min(ids), max(ids)
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise ValueError(f"{what}: token id {bad} is outside [0, vocab_size={vocab_size})")
    return ids


def token_batch(values: list, vocab_size: int):
    """``(lengths, ids)`` of a batch of feeds in one pass when each is a non-empty ``list`` of Python
    ``int`` ids in ``[0, vocab_size)``: ``lengths`` int64 [B] (``None`` when every feed is one token),
    ``ids`` int64 [sum(lengths)] (the feeds concatenated). ``None`` when anything else is there (empty
    feeds, numpy ids, bad values): the caller then checks each feed with :func:`token_ids`, which says
    what is wrong."""
    if set(map(type, values)) != {list} or not all(values):
        return None
    flat = list(itertools.chain.from_iterable(values))
    if set(map(type, flat)) != {int}:
        return None
    try:
        ids = np.array(flat, np.int64)
    except OverflowError:
        return None
    # One reduction checks both bounds: a negative id is a huge unsigned one.
    if int(ids.view(np.uint64).max()) >= vocab_size:
        return None
    # Every feed is non-empty, so as many ids as feeds means one each.
    return (None if len(flat) == len(values) else np.array(list(map(len, values)), np.int64)), ids


def token_array(tokens, count: int, vocab_size: int, what: str) -> np.ndarray:
    """``count`` token ids, one per request, as a new int64 array: from a 1-D integer numpy array or a
    sequence of integers (checked as :func:`token_ids` checks them), each ``0 <= t < vocab_size``."""
    if isinstance(tokens, np.ndarray):
        if tokens.dtype.kind not in "iu":
            raise TypeError(f"{what} must hold integer token ids, got an array of {tokens.dtype}")
        if tokens.ndim != 1:
            raise ValueError(f"{what} must be 1-D, got shape {tokens.shape}")
        ids = _ids_in_vocabulary(tokens, vocab_size, what)
    else:  # token_ids checked every id in Python: a decode loop's list of a few ids costs no numpy reduction
        ids = np.array(token_ids(tokens, vocab_size, what), np.int64)
    if len(ids) != count:
        raise ValueError(f"{what}: {len(ids)} token ids for {count} requests")
    return ids


def token_rows(tokens, count: int, vocab_size: int, what: str) -> np.ndarray:
    """Rows of ``count`` token ids each (a 2-D integer array or a list of lists of ints) as a new int64 array
    ``[rows, count]``, at least one row, each id ``0 <= t < vocab_size``; ``TypeError``/``ValueError`` naming
    ``what`` otherwise. One pass over all of them: no loop per row."""
    try:
        ids = np.array(tokens)
    except (ValueError, OverflowError) as error:  # ragged rows, ids past int64
        raise ValueError(f"{what}: not rows of {count} token ids ({error})") from None
    if ids.size == 0 and ids.dtype.kind == "f":  # numpy makes empty lists float: rows of an empty batch
        ids = ids.astype(np.int64)
    if ids.dtype.kind not in "iu":
        raise TypeError(f"{what} must hold integer token ids, got {ids.dtype}")
    if ids.ndim != 2 or ids.shape[0] < 1 or ids.shape[1] != count:
        raise ValueError(f"{what}: expected rows of {count} token ids, got shape {ids.shape}")
    return _ids_in_vocabulary(ids, vocab_size, what)


def _ids_in_vocabulary(tokens: np.ndarray, vocab_size: int, what: str) -> np.ndarray:
    """An integer array of token ids as a new int64 array; ``ValueError`` naming ``what`` for an id outside
    ``[0, vocab_size)`` (two reductions, whatever the shape)."""
    ids = tokens.astype(np.int64)
    if tokens.dtype.kind == "u" and ids.size and int(tokens.max()) >= _INT64_LIMIT:
        raise ValueError(f"{what}: token id {int(tokens.max())} is outside [0, vocab_size={vocab_size})")
    if ids.size and int(ids.view(np.uint64).max()) >= vocab_size:  # a negative id is a huge unsigned one
        bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
        raise ValueError(f"{what}: token id {bad} is outside [0, vocab_size={vocab_size})")
    return ids


def salt_bytes(salt) -> bytes:
    """The identity bytes of a tenant salt: ``None`` (the shared tenant), a ``str`` or ``bytes``.

    Type-tagged, so ``"1"`` and ``b"1"`` are different tenants; anything else is a ``TypeError``
    (``1``, ``True`` and ``1.0`` would otherwise be one tenant).
    """
    if salt is None:
        return b"n"
    if isinstance(salt, str):
        return b"s" + salt.encode("utf-8", "surrogatepass")
    if isinstance(salt, (bytes, bytearray)):
        return b"b" + bytes(salt)
    raise TypeError(f"salt must be None, str or bytes, got {type(salt).__name__} {salt!r}")


def key_bytes(value) -> bytes:
    """Injective, type-tagged bytes of a cache key: ``None``, ``bool``, ``int``, ``str``, ``bytes`` or a
    tuple/list of those (nested). Anything else (a float, a dict, an object) is a ``TypeError``."""
    if value is None:
        return b"N"
    if isinstance(value, (bool, np.bool_)):
        return b"T" if value else b"F"
    if isinstance(value, (numbers.Integral, np.integer)):
        number = int(value)  # two's complement, as few bytes as hold it and its sign: any size, one encoding each
        data = number.to_bytes(number.bit_length() // 8 + 1, "little", signed=True)
        return b"i" + len(data).to_bytes(8, "little") + data
    if isinstance(value, str):
        value = value.encode("utf-8", "surrogatepass")
        return b"s" + len(value).to_bytes(8, "little") + value
    if isinstance(value, (bytes, bytearray)):
        return b"b" + len(value).to_bytes(8, "little") + bytes(value)
    if isinstance(value, (tuple, list)):
        return b"(" + len(value).to_bytes(8, "little") + b"".join(key_bytes(v) for v in value)
    raise TypeError(f"cache_key must be built of None, bool, int, str, bytes and tuples of them, "
                    f"got {type(value).__name__} {value!r}")


def page_identity(salt, cache_key) -> bytes:
    """The bytes every page of a request is keyed by: its tenant salt and the cache's settings."""
    salt_part, key_part = salt_bytes(salt), key_bytes(cache_key)
    return len(salt_part).to_bytes(8, "little") + salt_part + key_part
