"""Integrations with other libraries; each is its own module and imports its library only when
used (none of them is needed to import flash_cutlass)."""
