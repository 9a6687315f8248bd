"""Tenant quotas: request rate with burst and concurrency per request; tokens per minute and
a daily token budget for LLM requests; open streams per tenant."""

from qosgate.quota.admission import Admission
from qosgate.quota.bucket import TokenBucket
from qosgate.quota.store import InMemoryQuotaStore, QuotaStore
from qosgate.quota.streams import StreamLimiter
from qosgate.quota.verdict import Admitted, Permit, Refused, Verdict

__all__ = [
    "Admission",
    "Admitted",
    "InMemoryQuotaStore",
    "Permit",
    "QuotaStore",
    "Refused",
    "StreamLimiter",
    "TokenBucket",
    "Verdict",
]
