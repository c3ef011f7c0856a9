"""Stock levels per sku."""

from __future__ import annotations


class OutOfStock(Exception):
    pass


class Inventory:
    def __init__(self) -> None:
        self.stock: dict[str, int] = {}

    def receive(self, sku: str, amount: int) -> None:
        self.stock[sku] = self.stock.get(sku, 0) + amount

    def take(self, sku: str, amount: int) -> int:
        have = self.stock.get(sku, 0)
        if amount > have:
            raise OutOfStock(sku)
        self.stock[sku] = have - amount
        return self.stock[sku]

    def low(self, limit: int = 3) -> list[str]:
        """Skus with fewer than `limit` left, by name."""
        return sorted(sku for sku, left in self.stock.items() if left < limit)

    def is_empty(self) -> bool:
        return not any(self.stock.values())
