"""Builds kvq's one C extension, the `kvq compress` quantizer (optional: without a C compiler kvq uses its
torch quantizer, which gives the same bytes). Everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvq.compress._int4",
            ["kvq/compress/_int4.c"],
            # IEEE fp32 exactly as torch computes it: no FMA contraction, no fast-math reassociation
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-fast-math", "-std=c11"],
            optional=True,
        )
    ]
)
