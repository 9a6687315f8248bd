"""Tenant quotas: request rate with burst, concurrency, tokens per minute, a daily budget."""

from qosgate.quota.admission import Admission
from qosgate.quota.bucket import TokenBucket, WindowBudget
from qosgate.quota.store import InMemoryQuotaStore, QuotaStore
from qosgate.quota.verdict import Admitted, Permit, Refused, Verdict

__all__ = [
    "Admission",
    "Admitted",
    "InMemoryQuotaStore",
    "Permit",
    "QuotaStore",
    "Refused",
    "TokenBucket",
    "Verdict",
    "WindowBudget",
]
