"""Torch hooks on ``pg.op_point`` are checked like patches, in both extraction modes: a value of
another shape, dtype or device than the node's on this call raises PatchError naming the NodePath
and the hook, before the graph goes on; a fitting one gives what the hook gives eagerly."""

import pytest
import torch

from fixtures.minimal_module import MinimalModule
from nnbridge import PatchableGraph
from nnbridge.errors import PatchError
from utils import opaque_and_compiled


def _wrong_shape(module, args, output):
    return output[:2]


def _wrong_dtype(module, args, output):
    return output.double()


def _wrong_device(module, args, output):
    return output.to("meta")


@opaque_and_compiled
@pytest.mark.parametrize("hook, given", [
    (_wrong_shape, r"shape \(2, 2\), torch\.float32, on cpu"),
    (_wrong_dtype, r"shape \(4, 2\), torch\.float64, on cpu"),
    (_wrong_device, r"shape \(4, 2\), torch\.float32, on meta"),
], ids=["shape", "dtype", "device"])
def test_wrong_value_from_a_hook_on_an_op_point(options, hook, given):
    torch.manual_seed(0)
    model = MinimalModule().eval()
    x = torch.randn(4, 3)
    pg = PatchableGraph(model, x, options=options)
    handle = pg.op_point("linear.output").register_forward_hook(hook)
    with pytest.raises(PatchError, match=rf"^A torch hook on the op point \({hook.__name__}\) on 'linear\.output' put a"
                                         rf" tensor of {given} in place of the node's value of shape \(4, 2\), "
                                         r"torch\.float32, on cpu\."):
        pg(x)
    handle.remove()
    assert torch.equal(pg(x), model(x))


@opaque_and_compiled
def test_fitting_hook_on_an_op_point_equals_the_same_hook_eagerly(options):
    torch.manual_seed(0)
    model, reference = MinimalModule().eval(), MinimalModule().eval()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(4, 3)
    pg = PatchableGraph(model, x, options=options)

    def negate(module, args, output):
        return -output
    pg.op_point("linear.output").register_forward_hook(negate)
    reference.linear.register_forward_hook(negate)
    assert torch.equal(pg(2 * x), reference(2 * x))  # and on another batch than the example's
    assert torch.equal(pg(x[:1]), reference(x[:1]))
