"""datalake package."""
