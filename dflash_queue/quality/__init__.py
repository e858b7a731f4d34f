"""The quality gate: judge every generated turn (empty, stub, truncated, unclosed thinking, loops) and decide."""
