"""The run's group ledger in Redis (`group_ledger.GroupLedger`): which prompt groups of every step
were drawn, written to the sample stream, cut and trained, the policy versions committed, and the
audit that says whether anything was lost or trained twice."""

from furlong.ledger.group_ledger import GroupLedger, LedgerAudit, audit, ledger_id

__all__ = ["GroupLedger", "LedgerAudit", "audit", "ledger_id"]
