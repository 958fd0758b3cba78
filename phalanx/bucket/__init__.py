"""The gradient bucket: its plan, flat storage and views, its cut into per-rank chunks, the step guard."""
