"""Compile the decode step's fused kernel variants for sm_90 (Hopper, the H200) ahead of time
with Triton's bundled ptxas, no GPU needed: run by test_kernel_compile_hopper.py in a process of
its own, without the interpreter. Prints one line per kernel: name, then the PTX instructions
the variant must contain that were found."""
import importlib
import inspect

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

G = importlib.import_module("tinyloop.kernels.gemv")
D = importlib.import_module("tinyloop.kernels.decode_attention")
TARGET = GPUTarget("cuda", 90, 32)


def compile_for_hopper(fn, types: dict, constexprs: dict, num_warps: int, num_stages: int):
    names = list(inspect.signature(fn.fn).parameters)
    sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=TARGET, options={"num_warps": num_warps, "num_stages": num_stages})


def main():
    bf16 = "*bf16"
    gemv_types = {n: bf16 for n in ["x_ptr", "w_ptr", "nw_ptr", "res_ptr", "y_ptr", "skip_ptr", "pw_ptr", "h_ptr"]}
    gemv_types.update({"key_ptr": "*i64", "pf1_ptr": "*u8", "pf2_ptr": "*u8", "eps": "fp32", "skip_eps": "fp32"})
    base = dict(RESIDUAL=False, ARGMAX=False, EVICT="evict_first", PREFETCH=True, PDL=True, BLOCK_KP=2048)
    # Ouro-1.4B's gate|up with the post-attention norm in its prologue (TILES' tile), and its wo
    # prefetching gate|up (the default tile)
    cases = {
        "gemv skip+norm+swiglu": (dict(base, NORM=True, SWIGLU=True, SKIP=True, L2_PF=False, BLOCK_N=8,
                                       BLOCK_K=512, ONE_CHUNK=False), 1, ["st.global"]),
        "gemv skip+norm one chunk": (dict(base, NORM=True, SWIGLU=False, SKIP=True, L2_PF=False, BLOCK_N=2,
                                          BLOCK_K=2048, ONE_CHUNK=True), 1, ["st.global"]),
        "gemv l2_prefetch": (dict(base, NORM=False, SWIGLU=False, SKIP=False, L2_PF=True, BLOCK_N=2,
                                  BLOCK_K=1024, ONE_CHUNK=False), 3, ["cp.async.bulk.prefetch.L2.global"]),
    }
    for name, (c, stages, want) in cases.items():
        ptx = compile_for_hopper(G._gemv_kernel, gemv_types, c, 4, stages).asm["ptx"]
        print(name, *[w for w in want if w in ptx])
    attn_types = {n: bf16 for n in ["q_ptr", "k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr", "o_ptr"]}
    attn_types.update({"cos_ptr": "*fp32", "sin_ptr": "*fp32", "positions_ptr": "*i64", "slots_ptr": "*i64",
                       "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "cnt_ptr": "*i32", "qk_scale": "fp32"})
    c = dict(BLOCK_G=16, BLOCK_N=128, BLOCK_D=128, INPUT_PRECISION="tf32", PDL=True, SLOTS=True, MERGE=True,
             PREFETCH_KV=True)
    ptx = compile_for_hopper(D._rope_decode_attention_split_kernel, attn_types, c, 4, D.SPLIT_STAGES).asm["ptx"]
    print("attention merge+prefetch_kv", *[w for w in ("atom.", "cp.async.bulk.prefetch.L2.global", "ld.global.cg")
                                          if w in ptx])


if __name__ == "__main__":
    main()
