module idemproxy.example/createorder

go 1.19
