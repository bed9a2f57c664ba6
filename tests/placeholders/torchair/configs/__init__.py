"""Import placeholder for ``torchair.configs`` (see ``torchair``)."""
