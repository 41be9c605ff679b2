"""Scheduling: request state, the tick (admission, chunked prefill, decode), the exact prefix cache, the step loop thread."""
