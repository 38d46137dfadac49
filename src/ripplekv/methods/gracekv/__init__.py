"""GraceKV: prototype trees competing for one global budget (`method`), and the parts its published form is built from."""
