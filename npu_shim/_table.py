"""Plain-text tables for the CLI and the selftest report."""


def format_table(headers, rows):
    """Left-aligned columns under a rule; cells are turned into text."""
    rows = [[str(cell) for cell in row] for row in rows]
    widths = [max(len(r[i]) for r in rows + [list(headers)]) for i in range(len(headers))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(line.rstrip() for line in lines)
