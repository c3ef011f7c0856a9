"""A tiny shop: carts, stock and receipts."""
