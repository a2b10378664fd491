"""What travels between stages besides the tensors themselves: a small header per step and
stage boundary, and tags that keep the three kinds of message apart.

The first activation message of a step across each stage boundary is preceded by a header
(count, length, and per tensor dtype, requires_grad, shape; the step's later micro-batches have the
same shapes, which the sender checks), so shapes need not be declared: the receiver learns
them on the first step, and the schedule posts later steps' receives early with the learned
shapes (a key made from the first stage's input shapes says whether they still hold; variable
sequence length changes the key: pytorch/pytorch#159942, NVIDIA/Megatron-LM#1066). Checking
the header against what was posted gives a clear error, instead of a hang, when a stage's
output shape changes under the same input shape.

Tags: each kind of message to stage s has its own tag, so a receive matches the right send
even when a rank posts receives of different kinds or stages in another order than its peer
sends them (point-to-point messages are matched by source and tag in posting order); each
step offsets them by ``tag_base``, so a failed step's leftover receives stay out of the next.
"""
import zlib

import torch

HEADER_LEN = 64
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64]


_TAG_LIMIT = 2**31 - 1  # tags are a C int


class ShapeMismatch(ValueError):
    """A stage's output shape changed under the same input shapes: raised by the sender and,
    reading the header, by the receiver."""


def tag_base(step, num_stages):
    """Offset added to every tag of step number ``step``. A step that failed half-way leaves
    receives posted that nothing will ever cancel; with tags of their own per step, the next
    step's messages cannot land in them (tags repeat only 2^31 / (3 * num_stages) steps later)."""
    span = 3 * num_stages
    return span * (step % max(1, _TAG_LIMIT // span))


def tag_activation(stage):
    return 3 * stage


def tag_header(stage):
    return 3 * stage + 1


def tag_gradient(stage):
    """Gradient of stage ``stage``'s outputs, sent back to it by stage + 1."""
    return 3 * stage + 2


def spec(t):
    return (tuple(t.shape), t.dtype, bool(t.requires_grad))


def specs(tensors):
    return [spec(t) for t in tensors]


def encode(tensors, stage):
    """The header messages: the first always ``HEADER_LEN`` numbers (what the receiver posts
    before it knows anything), then, for a boundary whose tensors need more, one message with
    the rest (its length is in the first)."""
    h = [len(tensors), 0]
    for t in tensors:
        if t.dtype not in DTYPES:
            raise TypeError(f"pipeline stage {stage}: cannot send a tensor of dtype {t.dtype}")
        h += [DTYPES.index(t.dtype), int(t.requires_grad), t.dim(), *t.shape]
    h[1] = len(h)
    h = torch.tensor(h + [0] * max(0, HEADER_LEN - len(h)), dtype=torch.int64)
    return [h[:HEADER_LEN], h[HEADER_LEN:]] if len(h) > HEADER_LEN else [h]


def extension_len(header):
    """How many numbers follow the first header message in a second one (0: none)."""
    return max(0, int(header[1]) - HEADER_LEN)


def decode(header):
    h = header.tolist()
    out, i = [], 2
    for _ in range(h[0]):
        dtype, rg, ndim = DTYPES[h[i]], bool(h[i + 1]), h[i + 2]
        out.append((tuple(h[i + 3:i + 3 + ndim]), dtype, rg))
        i += 3 + ndim
    return out


def empty(specs_, device=None):
    return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype, _ in specs_]


def describe(specs_):
    return "[" + ", ".join(f"{tuple(s)} {str(d).replace('torch.', '')}" + (" requiring grad" if rg else "")
                           for s, d, rg in specs_) + "]"


def _key_of(value):
    """A 63-bit number naming ``value`` by its repr (the same on every rank)."""
    text = repr(value)
    return zlib.crc32(text.encode()) | (len(text) << 32)


def key(tensors, train):
    """Names the first stage's input shapes."""
    return _key_of((train, [(tuple(t.shape), str(t.dtype), bool(t.requires_grad)) for t in tensors]))


def combine_keys(keys):
    """One key from several (the first stage's input key and each rank's trainable parameters)."""
    return _key_of(list(keys))
