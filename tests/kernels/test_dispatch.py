import pytest
import torch

from pagedserve.kernels.dispatch import kernel_path, numba_available, use_triton


def test_cpu_default_is_numba_where_a_kernel_has_it_else_reference(monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_KERNELS", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not use_triton(torch.zeros(1))
    assert kernel_path(torch.zeros(1)) == "ref"
    assert numba_available()  # a declared dependency of pagedserve-kernels
    assert kernel_path(torch.zeros(1), has_numba=True) == "numba"


def test_interpreter_selects_triton(monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_KERNELS", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert use_triton(torch.zeros(1))
    assert kernel_path(torch.zeros(1), has_numba=True) == "triton"


@pytest.mark.parametrize(
    ("forced", "has_numba", "expected"),
    [
        ("ref", True, "ref"),
        ("triton", True, "triton"),
        ("numba", True, "numba"),
        ("numba", False, "ref"),  # no numba path: the reference
    ],
)
@pytest.mark.parametrize("interpret", ["0", "1"])
def test_env_forces_a_path(monkeypatch, forced, has_numba, expected, interpret):
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    monkeypatch.setenv("PAGEDSERVE_KERNELS", forced)
    assert kernel_path(torch.zeros(1), has_numba=has_numba) == expected
    assert use_triton(torch.zeros(1)) is (expected == "triton")


def test_unknown_value_is_an_error(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_KERNELS", "cuda")
    with pytest.raises(ValueError, match="PAGEDSERVE_KERNELS"):
        use_triton(torch.zeros(1))
