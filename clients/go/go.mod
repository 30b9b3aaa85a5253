module github.com/idemq/idemq/clients/go

go 1.19
