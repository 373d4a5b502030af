"""Builds kvq's C extensions, both optional: without a C compiler kvq uses torch instead (the same bytes for
`kvq compress`; `aten._weight_int4pack_mm_for_cpu` for INT4 matmuls, eager torch ops for the bf16 norms).
Everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvq.compress._int4",
            ["kvq/compress/_int4.c"],
            depends=["kvq/formats/_pack_quantized.h"],
            # IEEE fp32 exactly as torch computes it: no FMA contraction, no fast-math reassociation
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-fast-math", "-std=c11"],
            optional=True,
        ),
        Extension(
            "kvq.runtime.kernels.cpu._linear",
            ["kvq/runtime/kernels/cpu/_linear.c"],
            depends=[
                "kvq/formats/_pack_quantized.h",
                "kvq/runtime/kernels/cpu/_linear_pool.h",
                "kvq/runtime/kernels/cpu/_linear_simd.h",
                "kvq/runtime/kernels/cpu/_linear_gemm.h",
                "kvq/runtime/kernels/cpu/_linear_bf16.h",
                "kvq/runtime/kernels/cpu/_linear_vnni.h",
                "kvq/runtime/kernels/cpu/_linear_amx.h",
                "kvq/runtime/kernels/cpu/_linear_dequant.h",
                "kvq/runtime/kernels/cpu/_w4a8.h",
                "kvq/runtime/kernels/cpu/_w4a8_vnni.h",
                "kvq/runtime/kernels/cpu/_w4a8_avx2.h",
                "kvq/runtime/kernels/cpu/_w4a8_isa.h",
                "kvq/runtime/kernels/cpu/_w8a16.h",
                "kvq/runtime/kernels/cpu/_w8a16_simd.h",
                "kvq/runtime/kernels/cpu/_w8a16_bf16.h",
                "kvq/runtime/kernels/cpu/_dense_amx.h",
            ],
            # one build for every x86 CPU: each ISA's loops (AVX2 up to AMX) carry their own target attributes
            extra_compile_args=["-O3", "-std=gnu11", "-pthread", "-ffp-contract=off", "-fno-fast-math"],
            extra_link_args=["-pthread"],
            optional=True,
        ),
        Extension(
            "kvq.runtime.kernels.cpu._ops",
            ["kvq/runtime/kernels/cpu/_ops.c"],
            depends=[
                "kvq/runtime/kernels/cpu/_ops_attention.h",
                "kvq/runtime/kernels/cpu/_ops_lanes.h",
                "kvq/runtime/kernels/cpu/_ops_stamps.h",
            ],
            # torch's bf16 rounding steps exactly: no FMA contraction, no fast-math reassociation
            extra_compile_args=[
                "-O3",
                "-std=c11",
                "-ffp-contract=off",
                "-fno-fast-math",
                "-fno-trapping-math",
                "-Wno-psabi",
            ],
            optional=True,
        ),
    ]
)
