"""Reliability and security tests: fuzzing, overload, faults, cancellation, determinism, soak."""
