"""The span processor's cost (`cargo xtask bench`, section otel): per span start + end, the
processor's own on_start + on_end on a real SDK span, with the C fast path and with the
pure-Python path; and a whole SDK span (start_span + end) on a provider without the
processor, with the fast one and with the pure one, all in alternating rounds. Prints
medians of the rounds and, for the hooks, the fastest round; passes or fails nothing.

Usage: span_cost.py [ROUNDS] [SPANS_PER_ROUND]"""

import statistics
import sys
import time

from opentelemetry.sdk.trace import TracerProvider

import pyrometer_otel

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 7
per_round = int(sys.argv[2]) if len(sys.argv) > 2 else 20000

paths = ["fast", "pure"] if pyrometer_otel.FAST else ["pure"]
processors = {p: pyrometer_otel.SpanProcessor(fast=(p == "fast")) for p in paths}
bare = TracerProvider().get_tracer("bench")
tracers = {"none": bare}
for p in paths:
    provider = TracerProvider()
    provider.add_span_processor(processors[p])
    tracers[p] = provider.get_tracer("bench")
span = bare.start_span("work")


def hook_pairs(processor):
    start, end = processor.on_start, processor.on_end
    t = time.perf_counter_ns()
    for _ in range(per_round):
        start(span, parent_context=None)
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


hooks = {p: [] for p in paths}
sdk = {k: [] for k in tracers}
loops = []
for _ in range(rounds):
    loops.append(empty_loop())
    for p in paths:
        hooks[p].append(hook_pairs(processors[p]))
    for k, tracer in tracers.items():
        sdk[k].append(spans(tracer))
m = statistics.median
if not pyrometer_otel.FAST:
    print("otel: no C fast path in this venv (pure-Python path only)")
for p in paths:
    # The minimum is the least disturbed round (on a shared machine the median carries the
    # neighbours' load); both are printed.
    print("otel processor on_start+on_end per span, %s path: %.0f ns median, %.0f ns min"
          " (empty loop %.0f ns)" % (p, m(hooks[p]), min(hooks[p]), m(loops)))
for p in paths:
    ratios = [w / n for w, n in zip(sdk[p], sdk["none"])]
    print("otel SDK span start+end, %s path: %.0f ns without the processor, %.0f ns with it"
          " (ratio %.2f, +%.0f ns)" % (p, m(sdk["none"]), m(sdk[p]), m(ratios),
                                       m(sdk[p]) - m(sdk["none"])))
