"""Running a broker: ``gpumesh serve``'s redis-server (``broker_server``), ``gpumesh run --local``'s
private mesh (``local``), and the Prometheus exporter (``metrics``)."""
