"""Import placeholder: torchair imports this module for its side effect on HCCL all-reduce in graphs; nothing here."""
