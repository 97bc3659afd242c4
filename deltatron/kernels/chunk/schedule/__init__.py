"""Scheduling of the chunk stages (DESIGN.md §7): the sequence split (forward) and the segmented backward."""
