"""Import placeholder (see ``torchair``)."""
