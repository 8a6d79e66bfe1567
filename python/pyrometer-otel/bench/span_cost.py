"""The span processor's cost (`cargo xtask bench`, section otel): per span start + end, the
processor's own on_start + on_end on a real SDK span, and a whole SDK span (start_span + end)
on a provider with and without the processor, in alternating rounds. Prints medians; passes
or fails nothing.

Usage: span_cost.py [ROUNDS] [SPANS_PER_ROUND]
Prints medians of the rounds, and for the processor also the fastest round."""

import statistics
import sys
import time

from opentelemetry.sdk.trace import TracerProvider

import pyrometer_otel

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 7
per_round = int(sys.argv[2]) if len(sys.argv) > 2 else 20000

processor = pyrometer_otel.SpanProcessor()
bare = TracerProvider().get_tracer("bench")
with_provider = TracerProvider()
with_provider.add_span_processor(processor)
traced = with_provider.get_tracer("bench")
span = bare.start_span("work")


def hook_pairs():
    start, end = processor.on_start, processor.on_end
    t = time.perf_counter_ns()
    for _ in range(per_round):
        start(span)
        end(span)
    return (time.perf_counter_ns() - t) / per_round


def spans(tracer):
    t = time.perf_counter_ns()
    for _ in range(per_round):
        tracer.start_span("work").end()
    return (time.perf_counter_ns() - t) / per_round


def empty_loop():
    t = time.perf_counter_ns()
    for _ in range(per_round):
        pass
    return (time.perf_counter_ns() - t) / per_round


hooks, loops, without, with_, ratios = [], [], [], [], []
for _ in range(rounds):
    loops.append(empty_loop())
    hooks.append(hook_pairs())
    a = spans(bare)
    b = spans(traced)
    without.append(a)
    with_.append(b)
    ratios.append(b / a)
m = statistics.median
# The minimum is the least disturbed round (on a shared machine the median carries the
# neighbours' load); both are printed.
print("otel processor on_start+on_end per span: %.0f ns median, %.0f ns min (empty loop %.0f ns)"
      % (m(hooks), min(hooks), m(loops)))
print("otel SDK span start+end: %.0f ns without the processor, %.0f ns with it (ratio %.2f, +%.0f ns)"
      % (m(without), m(with_), m(ratios), m(with_) - m(without)))
