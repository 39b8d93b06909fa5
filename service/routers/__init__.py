"""Routers per area of the API (DESIGN.md section 4)."""
