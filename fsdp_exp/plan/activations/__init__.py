"""The planner's activation models, one per model family: the bytes each block saves for backward and
the transient peaks of its forward and backward, derived from the family's own modules."""
