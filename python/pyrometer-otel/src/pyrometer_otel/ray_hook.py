"""Ray's tracing start-up hook: ``ray start --tracing-startup-hook=pyrometer_otel.ray_hook:setup_tracing``
(or ``ray.init(_tracing_startup_hook=...)`` for a cluster ``ray.init`` starts). Ray calls it in
the driver and in every worker it starts; Ray then runs each remote task and actor call
inside a span that continues the caller's trace, and this hook's processor publishes it, so
the task's samples carry the span of that invocation, on reused workers too.

A hook that also exports spans calls :func:`pyrometer_otel.install` on its own provider."""

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from . import install


def setup_tracing():
    provider = trace.get_tracer_provider()
    if not hasattr(provider, "add_span_processor"):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    install(provider)
