"""Bulk L2 prefetch (Hopper and later), shared by the launchers that ask L2 for bytes a later read
needs while the kernel before them still runs (before their PDL wait): kernels/gemv.py's
l2_prefetch, kernels/decode_attention.py's prefetch_kv.

A prefetch changes what L2 holds, never a value a kernel computes; nothing comes back to the
program (`cp.async.bulk.prefetch.L2`: the copy engine fetches the range). Not under the
interpreter, which runs no inline assembly: the launchers turn it off there.
"""
import triton
import triton.language as tl


@triton.jit
def bulk_prefetch_l2(addrs, nbytes):
    """Ask L2 for nbytes[i] bytes at addrs[i] (an int32 tensor of addrs' shape: multiples of 16,
    0 for none; addresses 16-byte aligned), one bulk prefetch per element."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [addrs, nbytes], dtype=tl.int32, is_pure=False, pack=1)
