"""Evidence scorer: student and teacher likelihood passes (fresh MoE routing) and PBSD turn weights."""
