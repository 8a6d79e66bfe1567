"""The C fast path (`pyrometer_otel._fastslot`) is optional: where it cannot be built (no
compiler, no Python headers, a free-threaded interpreter) pip installs the package without
it and the processor writes its slots in pure Python (see processor.py)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "pyrometer_otel._fastslot",
            ["src/pyrometer_otel/_fastslot.c"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-missing-field-initializers"],
            optional=True,
        )
    ]
)
