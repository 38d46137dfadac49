"""The model's linear layers on a few rows (engine.linear): the same outputs, the same weights, F.linear elsewhere."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ripplekv.engine.linear import FEW_ROWS, FewRowLinear, few_row_linears
from ripplekv.engine.prefill import prefill
from tests.conftest import tiny_llama


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(48,), (1, 48), (1, 1, 48), (2, 48), (3, 1, 48), (7, 1, 48), (1, 5, 48)])
def test_a_few_rows_give_what_f_linear_gives(shape, bias):
    torch.manual_seed(0)
    layer = nn.Linear(48, 80, bias=bias)
    x = torch.randn(*shape)
    expected = F.linear(x, layer.weight, layer.bias)
    few_row_linears(layer)
    assert type(layer) is FewRowLinear
    got = layer(x)
    assert got.shape == expected.shape and got.is_contiguous()
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [FEW_ROWS + 1, 40])
def test_many_rows_stay_f_linear_to_the_bit(rows):
    torch.manual_seed(1)
    layer = nn.Linear(64, 96)
    x = torch.randn(rows, 1, 64)
    expected = F.linear(x, layer.weight, layer.bias)
    few_row_linears(layer)
    assert torch.equal(layer(x), expected)


def test_the_model_keeps_its_weights_and_its_answers_within_float_tolerance():
    model = tiny_llama()
    weights = {name: p.data_ptr() for name, p in model.named_parameters()}
    ids = torch.randint(0, 101, (3, 1), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = model(ids).logits
        prefill(model, torch.arange(30))  # the engine makes the swap when it first prefills
        after = model(ids).logits
    assert {type(m) for m in model.modules() if isinstance(m, nn.Linear)} == {FewRowLinear}
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == weights  # no copy
    assert torch.allclose(before, after, atol=1e-5)
    few_row_linears(model)  # again: nothing changes
    assert {type(m) for m in model.modules() if isinstance(m, nn.Linear)} == {FewRowLinear}


def test_one_row_is_computed_as_two_equal_columns():
    """MKL's matrix-vector path is the slow one: a single row goes through a two-column product, whose first
    column is what the row would get beside a copy of itself."""
    torch.manual_seed(2)
    layer = nn.Linear(64, 96, bias=False)
    x = torch.randn(1, 64)
    pair = torch.mm(layer.weight, torch.cat([x, x]).t())[:, 0]
    few_row_linears(layer)
    assert torch.equal(layer(x)[0], pair)


def test_subclasses_of_linear_are_left_alone():
    class Quantized(nn.Linear):
        pass

    holder = nn.Sequential(nn.Linear(4, 4), Quantized(4, 4))
    few_row_linears(holder)
    assert [type(m) for m in holder] == [FewRowLinear, Quantized]
