"""Report.md and its plots."""
