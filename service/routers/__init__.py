"""Routers per area of the API (docs/service.md, "API")."""
