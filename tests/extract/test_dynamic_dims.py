"""ExtractionOptions.dynamic_dims: the dynamic dimensions of the extracted call's positional
arguments, the others static; root graphs read their inputs' sizes before the first op, as a
submodule's graph does."""

import pytest
import torch
from transformers.pytorch_utils import Conv1D

from nnbridge import ExtractionError, ExtractionOptions, PatchableGraph
from nnbridge.store.programs import options_fingerprint


def _conv():
    torch.manual_seed(0)
    return Conv1D(6, 4).eval()  # reads x.size(-1) (the hidden size) and x.size()[:-1]


def _sizes_read(pg):
    return [node.args[1] for node in pg._graph_module.graph.nodes
            if node.op == "call_function" and "sym_size" in str(node.target)]


def test_only_the_given_dimensions_are_dynamic():
    conv, x = _conv(), torch.randn(1, 5, 4)
    assert _sizes_read(PatchableGraph(conv, x)) == [2, 1], "every dimension dynamic: the hidden size is read"
    pg = PatchableGraph(conv, x, options=ExtractionOptions(dynamic_dims=((1,),)))
    assert _sizes_read(pg) == [1]
    for length in (5, 3, 8):  # one extraction serves other sequence lengths, faithfully
        other = torch.randn(1, length, 4)
        assert torch.equal(pg(other), conv(other))
    static = PatchableGraph(conv, x, options=ExtractionOptions(dynamic_dims=(None,)))
    assert _sizes_read(static) == [] and torch.equal(static(x), conv(x))


def test_root_graphs_read_input_sizes_before_the_first_op():
    pg = PatchableGraph(_conv(), torch.randn(1, 5, 4), options=ExtractionOptions(dynamic_dims=((1,),)))
    ops = [node for node in pg._graph_module.graph.nodes if node.op not in ("placeholder", "get_attr")]
    assert "sym_size" in str(ops[0].target) and ops[0].args[0].op == "placeholder"


@pytest.mark.parametrize("dims", [(1,), [[1], "a"], ((-1,),), ((True,),), "(1,)", 3])
def test_malformed_dims_raise_naming_the_form(dims):
    with pytest.raises(ValueError, match=r"dynamic_dims must be a tuple with one entry per positional argument"):
        ExtractionOptions(dynamic_dims=dims)


def test_dims_are_normalised():
    assert ExtractionOptions(dynamic_dims=[[2, 1, 1], None]).dynamic_dims == ((1, 2), None)


@pytest.mark.parametrize(("dims", "message"), [
    (((1,), None), r"dynamic_dims has 2 entries but the call has 1 positional arguments"),
    (((3,),), r"dynamic_dims\[0\] is \(3,\) but positional argument 0 has 3 dimensions: give indices below 3"),
])
def test_dims_that_do_not_fit_the_call_raise(dims, message):
    conv, x = _conv(), torch.randn(1, 5, 4)
    with pytest.raises(ExtractionError, match=message):
        PatchableGraph(conv, x, options=ExtractionOptions(dynamic_dims=dims))
    assert torch.equal(PatchableGraph(conv, x)(x), conv(x)), "nothing half-done: the module extracts again"


def test_dims_for_a_non_tensor_raise():
    class Scaled(torch.nn.Module):
        def forward(self, x, factor):
            return x * factor

    with pytest.raises(ExtractionError, match=r"dynamic_dims\[1\] is \(0,\) but positional argument 1 is a float"):
        PatchableGraph(Scaled(), torch.randn(2, 3), 2.0, options=ExtractionOptions(dynamic_dims=((0,), (0,))))


def test_dims_are_part_of_the_program_key():
    """A program exported with other dynamic dimensions is never served from the cache."""
    assert "dynamic_dims" not in options_fingerprint(ExtractionOptions())
    assert options_fingerprint(ExtractionOptions(dynamic_dims=((1,),)))["dynamic_dims"] == ((1,),)
