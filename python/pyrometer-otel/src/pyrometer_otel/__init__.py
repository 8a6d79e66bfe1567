"""Links pyrometer's CPU samples to OpenTelemetry traces.

    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    import pyrometer_otel

    provider = TracerProvider()
    provider.add_span_processor(pyrometer_otel.SpanProcessor())
    trace.set_tracer_provider(provider)

Samples pyrometer takes of a thread inside a span then carry ``trace_id``, ``span_id`` and
``span_name`` labels. ``FAST`` says whether the slots are written by the C extension (the
default where pip built it) or in pure Python (``PYROMETER_OTEL_PURE=1`` forces it). See
docs/src/tracing.md in the pyrometer repository.
"""

from .processor import FAST, SpanProcessor, shared_table
from .table import SpanTable

__all__ = ["FAST", "SpanProcessor", "SpanTable", "shared_table", "install"]


def install(provider=None):
    """Adds a SpanProcessor to ``provider`` (default: the global TracerProvider, which must
    be an SDK one) and returns it."""
    if provider is None:
        from opentelemetry import trace

        provider = trace.get_tracer_provider()
    if not hasattr(provider, "add_span_processor"):
        raise TypeError(
            "pyrometer_otel.install needs an SDK TracerProvider "
            f"(opentelemetry.sdk.trace.TracerProvider), not {type(provider).__name__}"
        )
    processor = SpanProcessor()
    provider.add_span_processor(processor)
    return processor
