"""The house's own rules, checked (tools/check_house.py runs them; tests/test_house_rules.py plants a breach of each)."""
