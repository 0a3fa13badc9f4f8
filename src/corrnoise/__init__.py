"""corrnoise."""
