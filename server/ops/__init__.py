"""The ops route's parts: the wire protocol both ends share, the handle table, op resolution."""
