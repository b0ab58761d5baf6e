import pytest
import torch

from pagedserve.kernels.dispatch import use_triton


def test_cpu_default_is_reference(monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_KERNELS", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not use_triton(torch.zeros(1))


def test_interpreter_selects_triton(monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_KERNELS", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert use_triton(torch.zeros(1))


@pytest.mark.parametrize(("forced", "expected"), [("ref", False), ("triton", True)])
def test_env_forces_a_path(monkeypatch, forced, expected):
    monkeypatch.setenv("TRITON_INTERPRET", "1" if not expected else "0")
    monkeypatch.setenv("PAGEDSERVE_KERNELS", forced)
    assert use_triton(torch.zeros(1)) is expected


def test_unknown_value_is_an_error(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_KERNELS", "cuda")
    with pytest.raises(ValueError, match="PAGEDSERVE_KERNELS"):
        use_triton(torch.zeros(1))
