"""Peak tensor memory of a call, for the tests that check chunking bounds memory."""

from torch.profiler import ProfilerActivity, profile


def peak_tensor_bytes(run) -> int:
    """Peak of the running sum of every op's own allocations and frees (torch profiler).

    ``tracemalloc`` cannot see these: torch does not allocate through Python.
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    current = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        current += event.self_cpu_memory_usage
        peak = max(peak, current)
    return peak
