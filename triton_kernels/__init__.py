"""Triton kernels of mpfused, installed as ``mpfused.triton_kernels`` (the bare top-level name
``triton_kernels`` belongs to other projects). Every kernel computes in fp32; bf16 tensors are
handed to kernels as int16 views and converted with integer ops (see ``_bits``), which is exact on
GPU and under TRITON_INTERPRET=1 alike (the interpreter mis-handles bf16 arithmetic and rounds
fp32->bf16 stores toward zero)."""
import triton  # noqa: F401  (ImportError here means: no Triton backend)
