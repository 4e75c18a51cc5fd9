"""State dicts in the layout compressed_opt wrote before torch's state_dict API took them
(compressed_opt.torch_state_dict): every per-parameter entry in ``state`` and no record carrier.
Tests that make a checkpoint of an older format, or damage one entry, start from it."""
from __future__ import annotations

from compressed_opt import torch_state_dict


def legacy(state_dict: dict) -> dict:
    """``state_dict`` (as ``optimizer.state_dict()`` returns it) with its record's entries back in
    the parameters' state and the carrier removed (a new dict; the tensors are shared)."""
    assert "compressed_opt" in state_dict, "a whole state dict of compressed_opt"
    return dict(torch_state_dict.unpack(state_dict, (), None, "legacy")[0])
