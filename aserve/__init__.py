"""aserve package."""
