"""Batch jobs: many requests submitted at once, run at the `batch` class through the same
admission and scheduler as interactive calls, persisted so they survive a restart.

`JobStore` keeps jobs, items and results (in this gateway's SQLite file, or in PostgreSQL
shared by every gateway); `JobRunner` dispatches pending items under leases;
`CallbackPolicy` decides which completion URLs may be called. Item requests and results
are opaque bytes here (serialized qosgate.v1 messages): only the edge reads them.
"""
