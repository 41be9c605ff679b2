"""Tensor parallelism over several processes: world formation with a settings handshake, the
admission journal that keeps every rank's scheduler in lockstep, op-stream digests, failure
detection, the RDMA fabric preflight and the local launcher (docs/tp.md)."""
