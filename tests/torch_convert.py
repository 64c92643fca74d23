"""numpy case inputs to torch tensors and back, with the reference's own int4 packing (not the torch
front-end's) so conversions are independent of the code under test."""

import numpy as np
import torch

from kvcache_op.reference import BFLOAT16, INT4, pack_int4, unpack_int4


def to_torch(array, device="cpu"):
    """A fresh torch tensor of ``array``: bfloat16 bit for bit; an int4 array (one code per byte in
    numpy) as torch's packed uint8 form, last dim halved."""
    if array is None:
        return None
    array = np.asarray(array)
    if array.dtype == INT4:
        packed = pack_int4(array).reshape(array.shape[:-1] + (array.shape[-1] // 2,))
        return torch.from_numpy(packed).to(device)
    if array.dtype == BFLOAT16:
        return torch.from_numpy(array.view(np.uint16).copy()).view(torch.bfloat16).to(device)
    return torch.from_numpy(array.copy()).to(device)


def to_numpy(tensor, like):
    """``tensor`` back as a numpy array of ``like``'s dtype and shape."""
    if tensor is None:
        return None
    tensor = tensor.detach().cpu()
    if like.dtype == INT4:
        return unpack_int4(tensor.numpy(), like.size).astype(INT4).reshape(like.shape)
    if like.dtype == BFLOAT16:
        return tensor.view(torch.int16).numpy().view(BFLOAT16)
    return tensor.numpy()


def torch_inputs(inputs, device="cpu", index_device=None):
    """Every case input as a torch tensor: data on ``device``, index inputs on ``index_device`` (default
    ``device``)."""
    data = ("current_key", "current_value", "cache", "scale", "query", "key", "value", "attn_mask")
    return {name: to_torch(value, device if name in data else (index_device or device))
            for name, value in inputs.items()}
